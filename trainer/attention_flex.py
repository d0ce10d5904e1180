"""FlexAttention over a packed row (``torch.nn.attention.flex_attention``).

The row's mask is the layout's ``visible`` as a mask_mod; its ``BlockMask`` is built once
per micro-batch and window size (the caller caches it over the layers) on the row
padded to whole 128-token blocks, and K/V reach the kernel at their kv heads
(``enable_gqa``): nothing is expanded to the query heads, in the forward or for the
backward. On CUDA the kernel is ``torch.compile(flex_attention, dynamic=True)``, compiled
once per process: padded lengths vary from row to row, and a dynamic graph does not
recompile for each (``benchmarks/flex_attention.py`` measures compile time and
recompiles; docs/attention.md). On CPU FlexAttention has no backward (torch 2.13), so the
trainer does not choose it there; its eager forward serves the CPU tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from trainer.row_layout import RowLayout

BLOCK_SIZE = 128
"""FlexAttention's block: rows are padded to a multiple of it."""


def padded_row_length(num_tokens: int) -> int:
    return max(1, -(-num_tokens // BLOCK_SIZE)) * BLOCK_SIZE


def row_block_mask(layout: RowLayout, window: int | None = None) -> BlockMask:
    """The row's BlockMask (cp 1), over its tokens padded to whole blocks. On CUDA the
    mask is built by a compiled pass: an eager one materializes [T, T] index tensors."""
    if layout.cp_size != 1:
        raise ValueError("FlexAttention rows: cp_size 1 only (CP gathers K/V for SDPA)")
    length = padded_row_length(len(layout.slot_T))
    device = layout.slot_T.device
    return create_block_mask(layout.mask_mod(length, window), None, None, length, length,
                             device=device, BLOCK_SIZE=BLOCK_SIZE,
                             _compile=device.type == "cuda")


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=True)


def flex_row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       block_mask: BlockMask, scale: float | None) -> torch.Tensor:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, Hq, T, D] under ``block_mask``
    (``row_block_mask``); GQA without copies."""
    num_tokens = query.shape[2]
    pad = block_mask.seq_lengths[0] - num_tokens
    if pad:
        query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    kernel = _compiled_flex() if query.device.type == "cuda" else flex_attention
    out = kernel(query, key, value, block_mask=block_mask, scale=scale,
                 enable_gqa=key.shape[1] != query.shape[1])
    return out[:, :, :num_tokens]
