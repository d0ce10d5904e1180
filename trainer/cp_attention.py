"""Context parallelism for Hugging Face causal LMs by all-gathering K/V (as in Llama 3 training).

Each CP rank holds its zigzag shard of every sequence (see ``context_parallel.py``): tokens plus
their true position ids, so RoPE rotates each token as in the full sequence. Inside every
attention layer the rank's K/V shards are all-gathered over the CP group, and each local query
attends to all keys under a causal mask built from true positions:

    out_i = softmax_j( q_i·k_j · scale  where pos(q_i) ≥ pos(k_j) ) · v_j

The gather is differentiable: a rank's K/V feed every rank's loss, so the gradient of its shard is
the sum over ranks of the gradient w.r.t. the gathered tensor, sliced to its own part.
Summing parameter gradients over the CP group then gives the full-sequence gradient.

Packed rows (several samples in one sequence) add ``sequence_ids``, the sample slot of each
token; a query then sees only keys of its own sample:

    mask_ij = (seq(q_i) = seq(k_j)) ∧ (pos(q_i) ≥ pos(k_j))

which is block-diagonal causal attention, with or without CP (at CP 1 nothing is gathered).

Shared prefix (CP 1): a sample that starts at position s_i of its row leaves its prompt
to its head h(i) (the first sample of its group in the row) and reads it from there:

    mask_ij = pos(q_i) ≥ pos(k_j) ∧ (seq(k_j) = seq(q_i) ∨ (seq(k_j) = h(q_i) ∧ pos(k_j) < s(q_i)))

A sample reading a prefix attends over [its head's first s_i tokens, its own tokens]
under [all | causal], runs of equal-length samples batched; a group of short samples
of many lengths is cheaper as one call under its [n, n] mask (``_Blocks``).

Usage: ``enable_context_parallel(model)`` once, then per forward
``with context_parallel(cp_group, position_ids, sequence_ids): model(input_ids=...,
position_ids=...)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

CP_ATTENTION_NAME = "tally_cp"
_PLANTED_ERROR_ENV = "TALLY_TEST_PLANTED_ERROR"
"""trainer/objective.py's PLANTED_ERROR_ENV (a test hook; ``prefix_mask`` is read here)."""


@dataclass(frozen=True)
class _CPState:
    group: dist.ProcessGroup
    positions_BS: torch.Tensor  # this rank's true positions [B, S_local]
    all_positions_BS: torch.Tensor  # every rank's, in rank order [B, cp·S_local]
    sequences_BS: torch.Tensor | None = None  # packed rows: sample slot of each token
    all_sequences_BS: torch.Tensor | None = None
    runs: _Runs | None = None  # a packed row without CP: per-sample causal attention
    blocks: _Blocks | None = None  # a packed row sharing prefixes (CP 1)


@dataclass(frozen=True)
class _Runs:
    """A packed row as runs of consecutive samples of equal length: (count, length) each.
    The step plan fills rows longest first, so equal lengths sit next to each other."""

    runs: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, sequence_ids_T: torch.Tensor) -> _Runs:
        runs: list[list[int]] = []
        for n in torch.bincount(sequence_ids_T).tolist():
            if runs and runs[-1][1] == n:
                runs[-1][0] += 1
            else:
                runs.append([1, n])
        return cls(tuple((count, n) for count, n in runs))


CALL_COST = 2**14
"""One attention call's fixed cost in units of query·key pairs (measured on CPU: a call
on a few tokens costs about as much as 128 × 128 pairs), for choosing a block's kernel."""


@dataclass(frozen=True)
class _Piece:
    """``count`` consecutive samples of ``length`` tokens in the row from ``start``, each
    attending causally to itself and to ``prefix_keys`` [a, b) of the row (its head's
    prompt; empty for a sample alone or a head), batched as [count, H, length, D]; or,
    with ``mask``, the ``length`` tokens from ``start`` under one [length, length] mask."""

    start: int
    count: int
    length: int
    prefix_keys: tuple[int, int] = (0, 0)
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class _Blocks:
    """A packed row with shared prefixes as attention pieces. Each group (a head and the
    samples reading its prompt) takes the cheaper of one call under its [n, n] mask and
    one call per run of equal-length samples under [prompt | causal] (``CALL_COST``)."""

    pieces: tuple[_Piece, ...]

    @classmethod
    def of(cls, sequence_ids_T: torch.Tensor, heads_T: torch.Tensor, starts_T: torch.Tensor,
           positions_T: torch.Tensor) -> _Blocks:
        slots, counts = torch.unique_consecutive(sequence_ids_T.cpu(), return_counts=True)
        firsts = (torch.cumsum(counts, 0) - counts).tolist()
        offset = dict(zip(slots.tolist(), firsts, strict=True))
        heads, skips = heads_T.cpu(), starts_T.cpu()
        planted = "prefix_mask" in os.environ.get(_PLANTED_ERROR_ENV, "")
        groups: list[list[_Piece]] = []
        for start, n in zip(firsts, counts.tolist(), strict=True):
            head, skip = int(heads[start]), int(skips[start])
            prefix = (offset[head], offset[head] + skip + planted) if skip else (0, 0)
            piece = _Piece(start, 1, n, prefix)
            if not skip:
                groups.append([piece])
                continue
            last = groups[-1][-1]
            if (last.length, last.prefix_keys) == (n, prefix):  # batched with the run
                groups[-1][-1] = _Piece(last.start, last.count + 1, n, prefix)
            else:
                groups[-1].append(piece)
        pieces: list[_Piece] = []
        for group in groups:
            start = group[0].start
            end = group[-1].start + group[-1].count * group[-1].length
            by_runs = sum(CALL_COST + p.count * p.length * (p.length + p.prefix_keys[1]
                                                            - p.prefix_keys[0]) for p in group)
            if len(group) == 1 or by_runs <= CALL_COST + (end - start) ** 2:
                pieces += group
                continue
            seq, pos = sequence_ids_T[start:end], positions_T[start:end]
            head = heads_T[start:end]
            first = starts_T[start:end] + planted
            mask = (pos[:, None] >= pos[None, :]) & (
                (seq[:, None] == seq[None, :])
                | ((seq[None, :] == head[:, None]) & (pos[None, :] < first[:, None])))
            pieces.append(_Piece(start, 1, end - start, mask=mask))
        merged: list[_Piece] = []  # neighbouring samples alone of one length: one batch
        for piece in pieces:
            last = merged[-1] if merged else None
            if (last is not None and piece.mask is None and last.mask is None
                    and piece.prefix_keys == last.prefix_keys == (0, 0)
                    and last.length == piece.length):
                merged[-1] = _Piece(last.start, last.count + piece.count, piece.length)
            else:
                merged.append(piece)
        return cls(tuple(merged))


def _run_view(x: torch.Tensor, start: int, count: int, n: int) -> torch.Tensor:
    """``count`` equal-length samples of n tokens from ``start`` of a row [1, H, T, D], as a
    batch [count, H, n, D] (a view: no copy)."""
    heads, dim = x.shape[1], x.shape[3]
    return x[0, :, start:start + count * n].reshape(heads, count, n, dim).transpose(0, 1)


def _shared_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             blocks: _Blocks, dropout: float, scale: float | None
                             ) -> torch.Tensor:
    """Attention of one packed row [1, H, T, D] piece by piece (``_Blocks``): a run of
    equal-length samples as a batch [count, H, L, D], those reading a prompt with its
    keys in front of their own under [all | causal]; a group under its own mask."""
    heads, dim = query.shape[1], query.shape[3]
    outputs = []
    for piece in blocks.pieces:
        start, count, n = piece.start, piece.count, piece.length

        q, k, v = (_run_view(x, start, count, n) for x in (query, key, value))
        a, b = piece.prefix_keys
        if piece.mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=piece.mask,
                                                 dropout_p=dropout, scale=scale)
        elif a == b:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale,
                                                 is_causal=True)
        else:
            k = torch.cat([key[:, :, a:b].expand(count, -1, -1, -1), k], dim=2)
            v = torch.cat([value[:, :, a:b].expand(count, -1, -1, -1), v], dim=2)
            mask = torch.ones(n, b - a + n, dtype=torch.bool, device=q.device)
            mask[:, b - a:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 scale=scale)
        outputs.append(out.transpose(0, 1).reshape(heads, count * n, dim))
    return torch.cat(outputs, dim=1)[None]


def _per_sample_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 runs: _Runs, dropout: float, scale: float | None
                                 ) -> torch.Tensor:
    """Block-diagonal causal attention of one packed row [1, H, T, D]: causal SDPA over
    each run of equal-length samples viewed as a batch [count, H, L, D] (views, no
    gather), so the work is Σ L² and no [T, T] score matrix is ever built."""
    heads, dim = query.shape[1], query.shape[3]
    outputs, start = [], 0
    for count, n in runs.runs:
        q, k, v = (_run_view(x, start, count, n) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale,
                                             is_causal=True)
        outputs.append(out.transpose(0, 1).reshape(heads, count * n, dim))
        start += count * n
    return torch.cat(outputs, dim=1)[None]


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


def cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention over the CP group's keys: q/k/v [B, heads, S, D] -> out [B, S, heads, D].

    No key-padding mask: sequences are right-padded and padding keeps counting positions, so a real
    query never sees a padding key (pos(pad) > pos(any real token)). HF builds no mask for an
    attention name it has no mask function for, so ``attention_mask`` is None here.
    """
    if attention_mask is not None:
        raise ValueError(f"{CP_ATTENTION_NAME} builds its mask from positions; pass no 4D mask")
    if sliding_window is not None:
        raise NotImplementedError(f"{CP_ATTENTION_NAME} does not support sliding-window layers")
    state = _state.get()
    if state is not None:
        if key.shape[2] != query.shape[2]:
            raise ValueError("context parallel attention does not support a KV cache")
        q_pos, k_pos = state.positions_BS, state.all_positions_BS
        if dist.get_world_size(state.group) > 1:
            # One collective for K and V together, so there is one backward all_reduce per layer.
            kv = _GatherSeq.apply(torch.stack((key, value)), state.group, 3)
            key, value = kv.unbind(0)
    else:
        kv_len, q_len = key.shape[2], query.shape[2]
        positions = kwargs.get("position_ids")
        q_pos = positions if positions is not None else torch.arange(kv_len - q_len, kv_len)
        q_pos = q_pos.to(query.device).expand(query.shape[0], q_len)
        # Without a cache the keys are the queries; with one they are the whole prefix so far.
        k_pos = q_pos if kv_len == q_len else torch.arange(kv_len, device=query.device)[None]
    num_groups = getattr(module, "num_key_value_groups", 1)
    if num_groups > 1:  # GQA: query head h reads kv head h // num_groups (HF's repeat_kv)
        key = key.repeat_interleave(num_groups, dim=1)
        value = value.repeat_interleave(num_groups, dim=1)
    if state is not None and state.blocks is not None:
        out = _shared_prefix_attention(query, key, value, state.blocks, dropout, scaling)
        return out.transpose(1, 2).contiguous(), None
    if state is not None and state.runs is not None:
        out = _per_sample_causal_attention(query, key, value, state.runs, dropout, scaling)
        return out.transpose(1, 2).contiguous(), None
    mask_BQK = q_pos[:, :, None] >= k_pos[:, None, :]
    if state is not None and state.sequences_BS is not None:  # packed: never across samples
        mask_BQK &= state.sequences_BS[:, :, None] == state.all_sequences_BS[:, None, :]
    mask_B1QK = mask_BQK.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask_B1QK, dropout_p=dropout, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def enable_context_parallel(model: PreTrainedModel) -> None:
    """Register (once) and switch the model's attention to the CP function."""
    # Registration is a class-wide dict update, so repeating it is harmless.
    AttentionInterface.register(CP_ATTENTION_NAME, cp_attention_forward)
    model.set_attn_implementation(CP_ATTENTION_NAME)


@contextmanager
def context_parallel(cp_group: dist.ProcessGroup, position_ids: torch.Tensor,
                     sequence_ids: torch.Tensor | None = None,
                     prefix_heads: torch.Tensor | None = None,
                     prefix_starts: torch.Tensor | None = None) -> Iterator[None]:
    """Within this block, attention layers of CP-enabled models gather K/V over cp_group.

    position_ids: [B, S_local] true positions of this rank's zigzag shard; sequence_ids: the
    sample slot of each token of a packed row (None: one sample per row); prefix_heads and
    prefix_starts: a row sharing prefixes (CP 1; see the module docstring). They are
    gathered here, once per forward, not in every layer. Run backward inside the block too when
    activation checkpointing recomputes attention there.
    """
    gather = dist.get_world_size(cp_group) > 1
    all_positions = _all_gather_positions(position_ids, cp_group) if gather else position_ids
    all_sequences = sequence_ids
    if sequence_ids is not None and gather:
        all_sequences = _all_gather_positions(sequence_ids, cp_group)
    runs = blocks = None
    if prefix_heads is not None:
        if gather or sequence_ids is None or prefix_starts is None:
            raise ValueError("shared_prefix: needs cp_size 1 and a packed row")
        blocks = _Blocks.of(sequence_ids[0], prefix_heads[0], prefix_starts[0],
                            position_ids[0])
    elif sequence_ids is not None and not gather and sequence_ids.shape[0] == 1:
        runs = _Runs.of(sequence_ids[0])
    token = _state.set(_CPState(cp_group, position_ids, all_positions, sequence_ids,
                                all_sequences, runs, blocks))
    try:
        yield
    finally:
        _state.reset(token)
