"""Work split over actors: contiguous, balanced slices of a list, one per actor."""

from __future__ import annotations


def shard_bounds(num_items: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous, balanced [start, end) slices (the first shards take the remainder);
    a shard may be empty when there are fewer items than shards."""
    base, extra = divmod(num_items, num_shards)
    bounds, start = [], 0
    for rank in range(num_shards):
        end = start + base + (rank < extra)
        bounds.append((start, end))
        start = end
    return bounds
