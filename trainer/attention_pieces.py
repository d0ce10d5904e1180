r"""Packed-row attention as SDPA calls over pieces of the row (the CPU-tuned kernel).

A row's mask (``trainer/row_layout.visible``) is block-diagonal causal, plus, for a
follower of a shared prefix, its head's first prefix_s keys. Rather than one [T, T]
mask, the row is cut into pieces that SDPA runs without a mask or with a small one:

- a run of ``count`` consecutive slots of one length n with no prefix: one causal call
  on the batch [count, H, n, D] (views of the row, no copy), so the work is Σ n²;
- a run of followers of one head and length: their head's prompt keys in front of their
  own, under [all | causal];
- a group (a head and its followers) of short slots of many lengths: one call under its
  own [m, m] mask, when that is cheaper than a call per run (``CALL_COST``).

K/V stay at their kv heads (SDPA's ``enable_gqa``). Only for rows a sliding window
cannot touch (``RowLayout.span`` ≤ window): the caller masks the others densely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.row_layout import RowLayout, visible

CALL_COST = 2**14
"""One attention call's fixed cost in units of query·key pairs (measured on CPU: a call
on a few tokens costs about as much as 128 × 128 pairs), for choosing a group's kernel."""


@dataclass(frozen=True)
class Piece:
    """``count`` consecutive slots of ``length`` tokens in the row from ``start``, each
    attending causally to itself and to ``prefix_keys`` [a, b) of the row (its head's
    prompt; empty for a slot alone or a head), batched as [count, H, length, D]; or,
    with ``mask``, the ``length`` tokens from ``start`` under one [length, length] mask."""

    start: int
    count: int
    length: int
    prefix_keys: tuple[int, int] = (0, 0)
    mask: torch.Tensor | None = None


def _group_mask(layout: RowLayout, start: int, end: int) -> torch.Tensor:
    """``visible`` among the row's tokens [start, end) (a head and its followers)."""
    slot, pos = layout.slot_T[start:end], layout.position_T[start:end]
    return visible(slot[:, None], pos[:, None], slot[None, :], pos[None, :],
                   layout.heads_N[slot][:, None], layout.prefix_N[slot][:, None])


def plan_pieces(layout: RowLayout) -> tuple[Piece, ...]:
    """The row as pieces (module docstring), from the layout's per-slot numbers only. A
    follower separated from its head's group still reads the head's keys by offset; only
    a group that starts with its head may take the one-mask kernel."""
    counts = layout.local_counts()
    offsets = [0]
    for c in counts[:-1]:
        offsets.append(offsets[-1] + c)
    heads, prefix = layout.heads_N.tolist(), layout.prefix_N.tolist()
    groups: list[list[Piece]] = []
    group_heads: list[int] = []
    for s, (start, n) in enumerate(zip(offsets, counts, strict=True)):
        h = heads[s]
        keys = (offsets[h], offsets[h] + prefix[s]) if h != s else (0, 0)
        piece = Piece(start, 1, n, keys)
        if h == s or not groups or group_heads[-1] != h:
            groups.append([piece])
            group_heads.append(h)
            continue
        last = groups[-1][-1]
        if (last.length, last.prefix_keys) == (n, keys):  # batched with the run
            groups[-1][-1] = Piece(last.start, last.count + 1, n, keys)
        else:
            groups[-1].append(piece)
    pieces: list[Piece] = []
    for group, head in zip(groups, group_heads, strict=True):
        start = group[0].start
        end = group[-1].start + group[-1].count * group[-1].length
        by_runs = sum(CALL_COST + p.count * p.length * (p.length + p.prefix_keys[1]
                                                        - p.prefix_keys[0]) for p in group)
        whole = group[0].start == offsets[head]  # the group holds its head
        if len(group) == 1 or not whole or by_runs <= CALL_COST + (end - start) ** 2:
            pieces += group
            continue
        pieces.append(Piece(start, 1, end - start, mask=_group_mask(layout, start, end)))
    merged: list[Piece] = []  # neighbouring slots alone of one length: one batch
    for piece in pieces:
        last = merged[-1] if merged else None
        if (last is not None and piece.mask is None and last.mask is None
                and piece.prefix_keys == last.prefix_keys == (0, 0)
                and last.length == piece.length):
            merged[-1] = Piece(last.start, last.count + piece.count, piece.length)
        else:
            merged.append(piece)
    return tuple(merged)


def _run_view(x: torch.Tensor, start: int, count: int, n: int) -> torch.Tensor:
    """``count`` equal-length slots of n tokens from ``start`` of a row [1, H, T, D], as a
    batch [count, H, n, D] (a view: no copy)."""
    heads, dim = x.shape[1], x.shape[3]
    return x[0, :, start:start + count * n].reshape(heads, count, n, dim).transpose(0, 1)


def pieces_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     pieces: tuple[Piece, ...], dropout: float, scale: float | None
                     ) -> torch.Tensor:
    """Attention of one packed row, query [1, Hq, T, D], key/value [1, Hkv, T, D], piece by
    piece: -> [1, Hq, T, D]."""
    heads, dim = query.shape[1], query.shape[3]
    gqa = key.shape[1] != heads
    outputs = []
    for piece in pieces:
        start, count, n = piece.start, piece.count, piece.length
        q, k, v = (_run_view(x, start, count, n) for x in (query, key, value))
        a, b = piece.prefix_keys
        if piece.mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=piece.mask,
                                                 dropout_p=dropout, scale=scale,
                                                 enable_gqa=gqa)
        elif a == b:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale,
                                                 is_causal=True, enable_gqa=gqa)
        else:
            k = torch.cat([key[:, :, a:b].expand(count, -1, -1, -1), k], dim=2)
            v = torch.cat([value[:, :, a:b].expand(count, -1, -1, -1), v], dim=2)
            mask = torch.ones(n, b - a + n, dtype=torch.bool, device=q.device)
            mask[:, b - a:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 scale=scale, enable_gqa=gqa)
        outputs.append(out.transpose(0, 1).reshape(heads, count * n, dim))
    return torch.cat(outputs, dim=1)[None]
