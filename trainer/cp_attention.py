"""Attention of packed rows and context parallelism for Hugging Face causal LMs.

Each CP rank holds its zigzag shard of every sequence (see ``context_parallel.py``): tokens plus
their true position ids, so RoPE rotates each token as in the full sequence. Inside every
attention layer the rank's K/V shards are all-gathered over the CP group, and each local query
attends to all keys under a causal mask built from true positions:

    out_i = softmax_j( q_i·k_j · scale  where pos(q_i) ≥ pos(k_j) ) · v_j

The gather is differentiable: a rank's K/V feed every rank's loss, so the gradient of its shard is
the sum over ranks of the gradient w.r.t. the gathered tensor, sliced to its own part.
Summing parameter gradients over the CP group then gives the full-sequence gradient.

A packed row (several samples, a shared prefix, a sliding window) is masked by its
``RowLayout`` (``trainer/row_layout.py``: the one ``visible(q, k)``), checked here once per
forward, with one of three kernels:

- ``flex_attention`` (``trainer/attention_flex.py``, cp 1, no dropout): FlexAttention
  under the row's BlockMask, built once per micro-batch and window size;
- SDPA pieces (``trainer/attention_pieces.py``: runs of equal-length samples, prefix
  keys in front, small group masks): the CPU-tuned kernel, where no window cuts the row;
- SDPA under the layout's dense mask: CP > 1 (keys all-gathered) and windowed rows.

K/V stay at their kv heads in every kernel (``enable_gqa``): no ``repeat_kv`` copies.

Usage: ``enable_context_parallel(model, kernel)`` once, then per forward
``with context_parallel(cp_group, position_ids, layout): model(input_ids=...,
position_ids=...)``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from trainer.attention_pieces import Piece, pieces_attention, plan_pieces
from trainer.row_layout import RowLayout

CP_ATTENTION_NAME = "tally_cp"
"""The SDPA kernels (pieces, dense masks, CP's all-gather)."""
FLEX_ATTENTION_NAME = "tally_flex"
"""FlexAttention for packed rows at cp 1 (SDPA where it cannot: CP, dropout)."""
Kernel = Literal["sdpa", "flex_attention"]


@dataclass
class _RowPlan:
    """What a row's kernels derive from its layout, once per micro-batch (every layer,
    and the policy's and the reference model's forwards, share it)."""

    pieces: tuple[Piece, ...] | None = None  # SDPA pieces, planned at the first layer
    block_masks: dict[int | None, Any] = field(default_factory=dict)  # window -> BlockMask


_row_plans: weakref.WeakKeyDictionary[RowLayout, _RowPlan] = weakref.WeakKeyDictionary()


@dataclass
class _CPState:
    group: dist.ProcessGroup | None
    positions_BS: torch.Tensor  # this rank's true positions [B, S_local]
    all_positions_BS: torch.Tensor  # every rank's, in rank order [B, cp·S_local]
    layout: RowLayout | None = None  # a packed row (B = 1)
    gather: bool = False
    row: _RowPlan = field(default_factory=_RowPlan)


_state: ContextVar[_CPState | None] = ContextVar("tally_cp_state", default=None)


class _GatherSeq(torch.autograd.Function):
    """All-gather along ``dim`` in rank order; backward sums the gradient over ranks, then slices.

    The sum is an all_reduce of the gathered-size gradient because gloo has no reduce_scatter.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.local_len = group, dim, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.local_len
        return grad.narrow(ctx.dim, start, ctx.local_len), None, None


def _all_gather_positions(positions_BS: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(positions_BS) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, positions_BS.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _row_attention(state: _CPState, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, kernel: Kernel, dropout: float, scale: float | None,
                   window: int | None) -> torch.Tensor:
    """One packed row [1, H, T, D] under its layout, by the kernel that can (docstring)."""
    layout = state.layout
    assert layout is not None
    if kernel == "flex_attention" and not state.gather and dropout == 0.0:
        from trainer.attention_flex import flex_row_attention, row_block_mask

        masks = state.row.block_masks
        if window not in masks:  # built by the first layer of each window
            masks[window] = row_block_mask(layout, window)
        return flex_row_attention(query, key, value, masks[window], scale)
    gqa = key.shape[1] != query.shape[1]
    if not state.gather and (window is None or layout.span <= window):
        if state.row.pieces is None:
            state.row.pieces = plan_pieces(layout)
        return pieces_attention(query, key, value, state.row.pieces, dropout, scale)
    mask = layout.dense_mask(window)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask[None, None],
                                          dropout_p=dropout, scale=scale, enable_gqa=gqa)


def cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    kernel: Kernel = "sdpa",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the CP group's keys: q [B, Hq, S, D], k/v [B, Hkv, S, D] ->
    out [B, S, Hq, D]; ``sliding_window``: a query sees the keys less than that many
    positions before it (Hugging Face's kv > q − window).

    No key-padding mask: sequences are right-padded and padding keeps counting positions, so a real
    query never sees a padding key (pos(pad) > pos(any real token)). HF builds no mask for an
    attention name it has no mask function for, so ``attention_mask`` is None here.
    """
    if attention_mask is not None:
        raise ValueError(f"{CP_ATTENTION_NAME} builds its mask from positions; pass no 4D mask")
    state = _state.get()
    gqa = key.shape[1] != query.shape[1]  # query head h reads kv head h // groups
    if state is not None:
        if key.shape[2] != query.shape[2]:
            raise ValueError("context parallel attention does not support a KV cache")
        if state.gather:
            # One collective for K and V together, so there is one backward all_reduce per layer.
            kv = _GatherSeq.apply(torch.stack((key, value)), state.group, 3)
            key, value = kv.unbind(0)
        if state.layout is not None:
            out = _row_attention(state, query, key, value, kernel, dropout, scaling,
                                 sliding_window)
            return out.transpose(1, 2).contiguous(), None
        q_pos, k_pos = state.positions_BS, state.all_positions_BS
    else:
        kv_len, q_len = key.shape[2], query.shape[2]
        positions = kwargs.get("position_ids")
        q_pos = positions if positions is not None else torch.arange(kv_len - q_len, kv_len)
        q_pos = q_pos.to(query.device).expand(query.shape[0], q_len)
        # Without a cache the keys are the queries; with one they are the whole prefix so far.
        k_pos = q_pos if kv_len == q_len else torch.arange(kv_len, device=query.device)[None]
    mask_BQK = q_pos[:, :, None] >= k_pos[:, None, :]
    if sliding_window is not None:
        mask_BQK &= q_pos[:, :, None] - k_pos[:, None, :] < sliding_window
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask_BQK.unsqueeze(1), dropout_p=dropout, scale=scaling,
        enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def enable_context_parallel(model: PreTrainedModel, kernel: Kernel = "sdpa") -> None:
    """Register (once) and switch the model's attention to the row/CP function, with
    ``kernel`` for packed rows at cp 1 (``flex_attention`` or the SDPA pieces)."""
    # Registration is a class-wide dict update, so repeating it is harmless.
    AttentionInterface.register(CP_ATTENTION_NAME, cp_attention_forward)
    AttentionInterface.register(FLEX_ATTENTION_NAME, functools.partial(
        cp_attention_forward, kernel="flex_attention"))
    model.set_attn_implementation(FLEX_ATTENTION_NAME if kernel == "flex_attention"
                                  else CP_ATTENTION_NAME)


@contextmanager
def context_parallel(cp_group: dist.ProcessGroup | None, position_ids: torch.Tensor,
                     layout: RowLayout | None = None) -> Iterator[None]:
    """Within this block, attention layers of CP-enabled models gather K/V over cp_group.

    cp_group: None for no CP (one rank: nothing is gathered, no process group needed).
    position_ids: [B, S_local] true positions of this rank's zigzag shard; ``layout``: a
    packed row's (``trainer/row_layout.py``; None: one sample per row), checked here
    against those positions, once per forward, not in every layer. Run backward inside
    the block too when activation checkpointing recomputes attention there.
    """
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    gather = cp_size > 1
    if layout is not None:
        if layout.cp_size != cp_size:
            raise ValueError(f"row layout: cut for cp_size {layout.cp_size}, the CP group "
                             f"has {cp_size} ranks")
        layout.check(position_ids)
        all_positions = position_ids  # the layout knows every rank's keys
    else:
        all_positions = (_all_gather_positions(position_ids, cp_group) if gather
                         else position_ids)
    row = _RowPlan() if layout is None else _row_plans.setdefault(layout, _RowPlan())
    token = _state.set(_CPState(cp_group, position_ids, all_positions, layout, gather, row))
    try:
        yield
    finally:
        _state.reset(token)
