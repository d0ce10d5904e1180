"""A sync's weights gathered a bucket at a time: one collective per bucket, not per tensor.

FSDP2 keeps each parameter as a DTensor sharded on dim 0 over the world (``Shard(0)``):
rank r holds rows [o_r, o_r + n_r) of it. A bucket (rollout/weight_bucket.py) holds
whole tensors back to back, cast to the engine's dtype. Every rank casts its rows of the
bucket's tensors to that dtype and packs them back to back; one gather brings each
rank's pack to rank 0, which copies every rank's rows to their place in the flat bucket:

    rank r's pack:      rows_r(t1) | rows_r(t2) | …        (padded to the largest pack)
    rank 0's bucket:    t1 = rows_0(t1) rows_1(t1) …  |  t2 = …   (at the specs' offsets)

Casting rows equals casting the whole tensor (elementwise), and the gather carries the
engine's dtype (bf16: half of fp32). A plain tensor (a buffer, a parameter FSDP left
whole) is packed whole by rank 0 alone; a DTensor laid out any other way is gathered
whole on its own first. The tiny model at DP 2 on CPU: 26 all-gathers (≈ 67 ms) become
one gather (≈ 3 ms). Rank 0 holds its pack, the gathered packs (about one bucket) and
the bucket; the other ranks their pack.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from rollout.weight_bucket import DTYPES, TensorSpec


def _row_sharded(tensor: torch.Tensor, world_size: int) -> bool:
    """A DTensor split on dim 0 over the whole world in rank order (FSDP2's layout)."""
    return (isinstance(tensor, DTensor) and tensor.ndim > 0
            and tuple(tensor.placements) == (Shard(0),)
            and tensor.device_mesh.mesh.flatten().tolist() == list(range(world_size)))


def shard_rows(owned: dict[str, torch.Tensor], world_size: int) -> dict[str, list[int]]:
    """Collective, once per model: name -> the rows each rank holds, of every row-sharded
    tensor (asked of the ranks, not derived from a split rule)."""
    names = [name for name, tensor in owned.items() if _row_sharded(tensor, world_size)]
    local = [int(owned[name].to_local().shape[0]) for name in names]
    every: list[list[int] | None] = [None] * world_size
    dist.all_gather_object(every, local)
    rows = {name: [int(held[k]) for held in every if held is not None]
            for k, name in enumerate(names)}
    for name, counts in rows.items():  # every rank has the same: all raise, none waits
        if sum(counts) != owned[name].shape[0]:
            raise RuntimeError(f"weight sync: the ranks hold {counts} rows of {name}, "
                               f"not its {owned[name].shape[0]}")
    return rows


def gather_buckets(owned: dict[str, torch.Tensor], buckets: Sequence[Sequence[TensorSpec]],
                   rows: dict[str, list[int]], rank: int, world_size: int,
                   device: torch.device | str = "cpu") -> Iterator[torch.Tensor | None]:
    """Collective: each bucket of ``buckets`` as one flat uint8 tensor on ``device`` on
    rank 0 (None on the others), in order; ``rows``: :func:`shard_rows`."""
    for specs in buckets:
        yield _gather_bucket(owned, specs, rows, rank, world_size, torch.device(device))


def _gather_bucket(owned: dict[str, torch.Tensor], specs: Sequence[TensorSpec],
                   rows: dict[str, list[int]], rank: int, world_size: int,
                   device: torch.device) -> torch.Tensor | None:
    whole: dict[str, torch.Tensor] = {}  # gathered on their own (any other layout)
    for spec in specs:
        tensor = owned[spec.name].detach()
        if spec.name not in rows and isinstance(tensor, DTensor):
            whole[spec.name] = tensor.full_tensor()
    # Each rank's pack: (name, byte offset in the pack, bytes) of the rows it sends.
    layout: list[list[tuple[str, int, int]]] = [[] for _ in range(world_size)]
    for spec in specs:
        if spec.name in rows:
            row_bytes = spec.num_bytes // max(spec.shape[0], 1)
            for r, n in enumerate(rows[spec.name]):
                used = layout[r][-1][1] + layout[r][-1][2] if layout[r] else 0
                layout[r].append((spec.name, used, n * row_bytes))
        else:
            used = layout[0][-1][1] + layout[0][-1][2] if layout[0] else 0
            layout[0].append((spec.name, used, spec.num_bytes))
    sizes = [sum(n for _, _, n in pieces) for pieces in layout]
    pack_device = next((t.device for t in owned.values() if isinstance(t, DTensor)), device)
    pack = torch.zeros(max(sizes), dtype=torch.uint8, device=pack_device)
    by_name = {spec.name: spec for spec in specs}
    for name, offset, num_bytes in layout[rank]:
        source = whole.get(name)
        if source is None:
            tensor = owned[name].detach()
            source = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        dtype = DTYPES[by_name[name].dtype]
        pack[offset:offset + num_bytes].view(dtype).copy_(source.reshape(-1))
    gathered = ([torch.empty_like(pack) for _ in range(world_size)] if rank == 0 else None)
    dist.gather(pack, gathered, dst=0)
    del pack
    if gathered is None:
        return None
    flat = torch.empty(sum(spec.num_bytes for spec in specs), dtype=torch.uint8,
                       device=device)
    placed = {spec.name: spec.offset for spec in specs}  # where the next rows go
    for r, pieces in enumerate(layout):
        for name, offset, num_bytes in pieces:
            start = placed[name]
            flat[start:start + num_bytes].copy_(gathered[r][offset:offset + num_bytes])
            placed[name] = start + num_bytes
    return flat
