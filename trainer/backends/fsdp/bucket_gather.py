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
whole on its own first. Where each byte goes is planned once (:func:`plan_gathers`).
The tiny model at DP 2 on CPU: 26 all-gathers (≈ 67 ms) become one gather (≈ 1.5 ms).
Rank 0 holds its pack, the gathered packs (about one bucket) and the bucket; the other
ranks their pack.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class BucketGather:
    """Where every byte of one bucket goes, worked out once per model and bucket size:
    ``pieces[r]`` lists (name, offset in rank r's pack, bytes, offset in the bucket) of
    what rank r sends, in spec order; ``whole``: DTensors laid out otherwise, gathered
    whole on their own first."""

    specs: tuple[TensorSpec, ...]
    pieces: tuple[tuple[tuple[str, int, int, int], ...], ...]
    pack_bytes: int
    bucket_bytes: int
    whole: tuple[str, ...]


def plan_gathers(owned: dict[str, torch.Tensor], buckets: Sequence[Sequence[TensorSpec]],
                 rows: dict[str, list[int]], world_size: int) -> list[BucketGather]:
    """One :class:`BucketGather` per bucket; ``rows``: :func:`shard_rows`."""
    plans = []
    for specs in buckets:
        pieces: list[list[tuple[str, int, int, int]]] = [[] for _ in range(world_size)]
        used = [0] * world_size
        for spec in specs:
            counts = rows.get(spec.name)
            if counts is None:  # whole on rank 0: a plain tensor, or gathered on its own
                pieces[0].append((spec.name, used[0], spec.num_bytes, spec.offset))
                used[0] += spec.num_bytes
                continue
            row_bytes = spec.num_bytes // max(spec.shape[0], 1)
            start = spec.offset
            for r, n in enumerate(counts):
                pieces[r].append((spec.name, used[r], n * row_bytes, start))
                used[r] += n * row_bytes
                start += n * row_bytes
        whole = tuple(spec.name for spec in specs
                      if spec.name not in rows and isinstance(owned[spec.name], DTensor))
        plans.append(BucketGather(tuple(specs), tuple(map(tuple, pieces)), max(used),
                                  sum(spec.num_bytes for spec in specs), whole))
    return plans


def gather_buckets(owned: dict[str, torch.Tensor], plans: Sequence[BucketGather],
                   rank: int, device: torch.device | str = "cpu"
                   ) -> Iterator[torch.Tensor | None]:
    """Collective: each bucket of ``plans`` as one flat uint8 tensor on ``device`` on rank
    0 (None on the others), in order."""
    device = torch.device(device)
    local = {name: (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
             for name, tensor in owned.items()}
    pack_device = next((t.device for t in local.values()), device)
    for plan in plans:
        yield _gather_bucket(owned, local, plan, rank, pack_device, device)


def _gather_bucket(owned: dict[str, torch.Tensor], local: dict[str, torch.Tensor],
                   plan: BucketGather, rank: int, pack_device: torch.device,
                   device: torch.device) -> torch.Tensor | None:
    sources = dict(local)
    for name in plan.whole:  # every rank, in spec order: a collective each
        sources[name] = owned[name].detach().full_tensor()
    dtypes = {spec.name: DTYPES[spec.dtype] for spec in plan.specs}
    pack = torch.empty(plan.pack_bytes, dtype=torch.uint8, device=pack_device)
    for name, offset, num_bytes, _ in plan.pieces[rank]:  # padding past them: never read
        pack[offset:offset + num_bytes].view(dtypes[name]).copy_(sources[name].reshape(-1))
    world_size = len(plan.pieces)
    gathered = (torch.empty(world_size, plan.pack_bytes, dtype=torch.uint8,
                            device=pack_device) if rank == 0 else None)
    dist.gather(pack, None if gathered is None else list(gathered.unbind(0)), dst=0)
    del pack
    if gathered is None:
        return None
    flat = torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device)
    for r, pieces in enumerate(plan.pieces):
        for _, offset, num_bytes, start in pieces:
            flat[start:start + num_bytes].copy_(gathered[r, offset:offset + num_bytes])
    return flat
