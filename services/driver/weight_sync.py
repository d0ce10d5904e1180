"""The trainer's weights to the rollout engines, once per rollout step, in buckets.

    WeightSync.start(v):  transport.send(v): the ranks gather, cast and send the weights a
                          bucket at a time (collective, bounded by trainer.call_timeout_s;
                          a dead rank raises TrainerRankDied and the job restarts); the
                          engines load them queued behind the rollouts already asked for
                          (services/driver/pipeline.py) and flip to v when every bucket
                          is in
    WeightSync.poll():    a load that finished with an error raises here
    WeightSync.wait():    every load started is done (before an evaluation is read, a
                          checkpoint, the end)

Weights version v = the rollout steps trained into them. Transports
(``trainer.weight_sync.transport``; JobConfig.weight_transport resolves ``auto``):

    in_process    the colocated fast path (services/driver/colocated.py): every rank
                  stages the weights for the torch engine in its own process (one rank,
                  synchronous: aliased, nothing copied; else synchronous: in place into
                  the served tensors; async: into reused buffer sets), served in the
                  manager's order
    object_store  rank 0 puts each bucket in Ray's object store as it is packed; every
                  engine maps them in place (torch engines; an SGLang engine writes them
                  to disk for its server: ``disk``)
    nccl          rank 0 broadcasts each bucket to the SGLang servers, which join a
                  weight-update group once (/init_weights_update_group) and receive each
                  bucket with /update_weights_from_distributed
    cuda_ipc      rank 0 hands each bucket's CUDA IPC handles to the SGLang server on its
                  GPU (/update_weights_from_tensor), one bucket at a time

The bucket format is rollout/weight_bucket.py's; the sync's time, bytes and peak memory
per rank go into the step's row (``perf/sync_bytes``, ``perf/peak_mem_gb/sync``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import ray

WEIGHT_GROUP = "tally_weights"


class WeightTransport(Protocol):
    def send(self, version: int) -> tuple[Any, dict[str, float]]:
        """Start sending weights ``version``: the engines' load (a ref to wait for) and
        the sync's metrics."""
        ...


class ObjectStoreTransport:
    """Buckets through Ray's object store: rank 0 puts each, the engines read them."""

    def __init__(self, trainer: Any, manager: Any, dtype: str, bucket_mb: float) -> None:
        self.trainer, self.manager, self.dtype, self.bucket_mb = (trainer, manager, dtype,
                                                                  bucket_mb)

    def send(self, version: int) -> tuple[Any, dict[str, float]]:
        buckets, metrics = self.trainer.async_export_weight_buckets(self.dtype, self.bucket_mb)
        # [ref]: the manager receives the ref, not the bucket list fetched into it
        return self.manager.update_weight_buckets.remote([buckets], version), metrics


class DistributedTransport:
    """NCCL broadcast from trainer rank 0 to every SGLang server (GPU only)."""

    def __init__(self, trainer: Any, manager: Any, dtype: str, bucket_mb: float,
                 fetch: Callable[[Any, str], Any]) -> None:
        self.trainer, self.manager, self.fetch = trainer, manager, fetch
        self.dtype, self.bucket_mb = dtype, bucket_mb
        self.joined = False

    def send(self, version: int) -> tuple[Any, dict[str, float]]:
        if not self.joined:  # once per start of the actors: the servers and rank 0 meet
            address, port = self.trainer.weight_group_address()
            num_engine_ranks = self.fetch(self.manager.num_weight_ranks.remote(),
                                          "num_weight_ranks")
            joined = self.manager.init_weights_update_group.remote(
                address, port, WEIGHT_GROUP, 1 + num_engine_ranks)
            self.trainer.join_weight_group(address, port, 1 + num_engine_ranks, WEIGHT_GROUP)
            self.fetch(joined, "init_weights_update_group")
            self.joined = True
        specs = self.trainer.weight_bucket_specs(self.dtype, self.bucket_mb)
        load = self.manager.update_weights_from_distributed.remote(specs, version,
                                                                   WEIGHT_GROUP)
        # The servers wait in each bucket's broadcast (behind the rollouts in flight).
        metrics = self.trainer.broadcast_weight_buckets(self.dtype, self.bucket_mb)
        return load, metrics


class CudaIpcTransport:
    """CUDA IPC handles of one bucket at a time to the SGLang server on rank 0's GPU."""

    def __init__(self, trainer: Any, manager: Any, dtype: str, bucket_mb: float,
                 fetch: Callable[[Any, str], Any]) -> None:
        self.trainer, self.manager, self.fetch = trainer, manager, fetch
        self.dtype, self.bucket_mb = dtype, bucket_mb

    def send(self, version: int) -> tuple[Any, dict[str, float]]:
        specs = self.trainer.weight_bucket_specs(self.dtype, self.bucket_mb)
        tp_size = self.fetch(self.manager.num_weight_ranks.remote(), "num_weight_ranks")
        metrics: dict[str, float] = {}
        for index in range(len(specs)):  # the server copies a bucket before the next
            handles, metrics = self.trainer.share_weight_bucket(index, self.dtype,
                                                                self.bucket_mb, tp_size)
            last = index == len(specs) - 1
            self.fetch(self.manager.update_weights_from_tensor.remote(
                handles, version if last else None), "update_weights_from_tensor")
        self.trainer.release_shared_bucket()
        return self.manager.ping.remote(), metrics


class InProcessTransport:
    """The colocated fast path: each rank stages the weights for the engine in its own
    process (aliased: nothing at all), which serves them in the manager's order."""

    def __init__(self, trainer: Any, manager: Any) -> None:
        self.trainer, self.manager = trainer, manager

    def send(self, version: int) -> tuple[Any, dict[str, float]]:
        metrics = self.trainer.stage_engine_weights(version)
        return self.manager.serve_staged_weights.remote(version), metrics


def transport_for(kind: str, trainer: Any, manager: Any, dtype: str, bucket_mb: float,
                  fetch: Callable[[Any, str], Any]) -> WeightTransport:
    if kind == "in_process":
        return InProcessTransport(trainer, manager)
    if kind in ("object_store", "disk"):  # an SGLang engine writes the buckets to disk
        return ObjectStoreTransport(trainer, manager, dtype, bucket_mb)
    if kind == "nccl":
        return DistributedTransport(trainer, manager, dtype, bucket_mb, fetch)
    if kind == "cuda_ipc":
        return CudaIpcTransport(trainer, manager, dtype, bucket_mb, fetch)
    raise ValueError(f"trainer.weight_sync.transport: unknown transport {kind!r}")


class WeightSync:
    def __init__(self, transport: WeightTransport, fetch: Callable[[Any, str], Any]) -> None:
        """``fetch(ref, verb)``: a load's answer within the rollout call timeout."""
        self.transport, self.fetch = transport, fetch
        self.pending: list[Any] = []

    def start(self, version: int) -> dict[str, float]:
        """Send now; the engines load in the manager's order while the driver goes on.
        Returns the sync's metrics (time, bytes, peak memory per rank)."""
        load, metrics = self.transport.send(version)
        self.pending.append(load)
        return metrics

    def poll(self) -> None:
        """Collect the loads that are done (raising a failed one's error), without waiting."""
        if self.pending:
            done, self.pending = ray.wait(self.pending, num_returns=len(self.pending),
                                          timeout=0)
            for ref in done:
                self.fetch(ref, "update_weights")

    def wait(self) -> None:
        """Every load started is done."""
        pending, self.pending = self.pending, []
        for ref in pending:
            self.fetch(ref, "update_weights")
