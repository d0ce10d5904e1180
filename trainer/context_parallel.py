"""Megatron's zigzag layout for context parallelism (CP).

Each sequence is padded to a multiple of 2·cp and cut into 2·cp equal chunks; CP rank r
keeps chunks r and 2·cp−1−r. Pairing an early chunk with a late one balances causal
attention work across ranks. Every per-token tensor of a step (tokens, positions, loss
mask, aggregation weights) is sharded with the same function, so a rank's Σ w·ℓ is over
exactly the tokens it owns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def padded_length(seq_len: int, cp_size: int) -> int:
    """Smallest multiple of 2·cp that holds seq_len tokens (no padding without CP)."""
    if cp_size == 1:
        return seq_len
    chunk_multiple = 2 * cp_size
    return -(-seq_len // chunk_multiple) * chunk_multiple


def zigzag_shard(
    tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = -1, pad_value: float = 0
) -> torch.Tensor:
    """The tokens CP rank ``cp_rank`` owns along the sequence dim ``dim``.

    Pads with ``pad_value`` (use 0 for masks and weights: padding is never a phantom token).
    """
    if cp_size == 1:
        return tensor
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    dim = dim % tensor.ndim
    seq_len = tensor.shape[dim]
    if seq_len == 0:  # nothing to own (chunk() of an empty dim would not give 2·cp parts)
        return tensor
    pad = padded_length(seq_len, cp_size) - seq_len
    if pad:
        # F.pad lists pads from the last dim backwards.
        pad_spec = [0, 0] * (tensor.ndim - 1 - dim) + [0, pad]
        tensor = F.pad(tensor, pad_spec, value=pad_value)
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """True position ids of the tokens a CP rank owns (padding continues the count)."""
    positions = torch.arange(padded_length(seq_len, cp_size))
    return zigzag_shard(positions, cp_size, cp_rank)


def zigzag_unshard(shards: list[torch.Tensor], seq_len: int, dim: int = -1) -> torch.Tensor:
    """Inverse of zigzag_shard: the full sequence from every rank's shard, padding cut."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp_size - 1 - rank] = first, second
    full = torch.cat(chunks, dim=dim)  # type: ignore[arg-type]
    return full.narrow(dim % full.ndim, 0, seq_len)
