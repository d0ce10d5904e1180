"""NCCL transport, the ranks' half: a process group shared with SGLang servers and the
broadcast of each weight bucket over it (rank 0 meets the servers; the driver's half is
services/driver/transports/nccl.py, the servers' rollout/engines/sglang_engine.py).

Over a process group (rollout/engines/sglang_engine.py has the HTTP side):

    trainer rank 0                                  each SGLang server (tp_size GPUs)
    init_weight_update_group(addr, port, W, name)   POST /init_weights_update_group
      hosts the rendezvous (a TCPStore at           {master_address: addr, master_port: port,
      addr:port) and is rank 0 of the group          rank_offset: r, world_size: W,
                                                      group_name: name, backend}
                                                    → its TP rank k is rank r + k
    for each bucket, in order:                      POST /update_weights_from_distributed
      broadcast_bucket(group, tensors, flattened)   {names, dtypes, shapes, group_name,
                                                     flush_cache, weight_version on the last,
                                                     load_format: "flattened_bucket"?}

W is 1 + the TP sizes of every server; both sides block in the rendezvous until all W
ranks have joined, and in each bucket until both have called. The group lives outside
the trainer's own world (SGLang's ranks are in no world of the trainer's), built the way
SGLang builds its end (sglang.srt.utils.common.init_custom_process_group, which its
WeightUpdater.init_weights_update_group calls with init_method "tcp://addr:port"): a
``tcp://`` rendezvous giving a TCPStore, a PrefixStore named after the group, and
torch.distributed's own ``_new_process_group_helper`` with no global ranks. Both ends must
agree on every store key that helper derives from the group name, so the trainer's end
takes the same path rather than a look-alike. NCCL refuses two ranks of one group on one
GPU ("Duplicate GPU detected"): a server sharing the trainer's GPU needs backend "gloo"
(which moves CUDA tensors through the host) or, better, update_weights_from_tensor.

A flattened bucket is one uint8 buffer: the bucket's tensors back to back from byte 0 in
the order of its names, each the raw bytes of its dtype, which is exactly
WeightBucket.data (SGLang's FlattenedTensorBucket.empty allocates the same buffer from
names, dtypes and shapes and views the tensors out of it). Not flattened, every tensor is
broadcast on its own, in the order of the names, as SGLang receives them.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.memory import PeakMemory, phase_metrics
from trainer.transports.base import BucketSource


def init_weight_update_group(master_address: str, master_port: int, world_size: int,
                             group_name: str, backend: str = "nccl",
                             timeout_s: float = 600.0) -> dist.ProcessGroup:
    """Create the weight-update group ``group_name`` of ``world_size`` ranks with this
    process, trainer rank 0, as its rank 0, hosting the rendezvous at
    master_address:master_port. Blocks until every server's ranks have joined
    (POST /init_weights_update_group on each, meanwhile). Runs beside, never inside, the
    trainer's own world; on a CUDA device the caller has made current."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _get_default_group,
        _new_process_group_helper,
        _world,
    )

    if world_size < 2:
        raise ValueError(f"init_weight_update_group: world_size {world_size}: the trainer "
                         f"and at least one server rank")
    if dist.is_initialized() and _get_default_group().bound_device_id is not None:
        # torch would then make the group by splitting the trainer's world's communicator,
        # a collective of the trainer's ranks that no server takes part in.
        raise RuntimeError("init_weight_update_group: the trainer's world is bound to a "
                           "device (init_process_group(device_id=...)); the weight-update "
                           "group cannot be made beside it")
    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, size = next(dist.rendezvous(f"tcp://{host}:{master_port}", rank=0,
                                             world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(size, rank, [], Backend(backend),
                                         PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    # As SGLang does: group ranks are their own global ranks, so src=0 names rank 0.
    _world.pg_group_ranks[group] = {i: i for i in range(size)}
    return group


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    """Leave the group (SGLang's side: POST /destroy_weights_update_group)."""
    dist.destroy_process_group(group)


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The flattened bucket of ``tensors`` (in the bucket's order): one contiguous uint8
    buffer of their bytes back to back. A single 1-D uint8 tensor already is one."""
    if len(tensors) == 1 and tensors[0].dtype == torch.uint8 and tensors[0].dim() == 1:
        return tensors[0].contiguous()
    return torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors])


def broadcast_bucket(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor],
                     flattened: bool) -> None:
    """Send one bucket from rank 0 of ``group`` while each server receives it (its POST
    /update_weights_from_distributed for this bucket). ``tensors``: on the group's device
    (CUDA for NCCL), in the order of the bucket's names, each in the dtype and shape the
    request names; flattened, they go as one uint8 buffer (``flatten_bucket``; or pass
    the bucket's buffer itself, WeightBucket.data on the device). Returns once the
    broadcasts are done."""
    if not tensors:
        raise ValueError("broadcast_bucket: an empty bucket (SGLang refuses them)")
    if flattened:
        dist.broadcast(flatten_bucket(tensors), group=group, group_src=0)
        return
    works = [dist.broadcast(t.contiguous(), group=group, group_src=0, async_op=True)
             for t in tensors]
    for work in works:
        if work is not None:
            work.wait()


@dataclass(unsafe_hash=True)
class NcclSender:
    """Rank 0 broadcasts each bucket, packed on its GPU, to the servers of the group
    ``group_name``, which rank 0 joins once (``address`` then ``join``)."""

    dtype: str
    bucket_mb: float
    group_name: str
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    """The weight-update group, once rank 0 has joined it (on the rank's own copy)."""

    def address(self, rank: BucketSource) -> tuple[str, int]:
        """Rank 0: where the group's rendezvous will listen (this node, a port free now:
        rank 0 binds it in ``join``)."""
        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, rank: BucketSource, address: str, port: int, world_size: int) -> None:
        """Rank 0: host and join the group while the servers join it."""
        self.group = init_weight_update_group(address, port, world_size, self.group_name,
                                              timeout_s=rank.config.collective_timeout_s)

    def specs(self, rank: BucketSource) -> list:
        """Collective (the first time, on some backends): the buckets' specs, which the
        servers need before the first broadcast."""
        return rank.weight_bucket_specs(self.dtype, self.bucket_mb)

    def send(self, rank: BucketSource, version: int) -> tuple[None, dict[str, float]]:
        """Collective: each bucket packed on rank 0's GPU and broadcast as one flattened
        tensor (the servers' /update_weights_from_distributed receives it)."""
        started = time.perf_counter()
        with PeakMemory(rank.device) as peak:
            for flat in rank.weight_buckets(self.dtype, self.bucket_mb, device=str(rank.device)):
                if flat is not None:
                    if self.group is None:
                        raise RuntimeError("nccl weight sync: rank 0 never joined the group")
                    broadcast_bucket(self.group, [flat], flattened=True)
                del flat
        return None, {"perf/export_s": time.perf_counter() - started,
                      **phase_metrics("sync", peak)}
