"""The trainer's weights to the rollout engines, once per rollout step, in buckets.

    WeightSync.start(v):  transport.send_weights(v): the ranks gather, cast and send the weights a
                          bucket at a time (collective, bounded by trainer.call_timeout_s;
                          a dead rank raises TrainerRankDied and the job restarts); the
                          engines load them queued behind the rollouts already asked for
                          (services/driver/pipeline.py) and flip to v when every bucket
                          is in
    WeightSync.poll():    a load that finished with an error raises here
    WeightSync.wait():    every load started is done (before an evaluation is read, a
                          checkpoint, the end)
    WeightSync.follow(r): a replacement engine's load of the current weights, polled and
                          waited for like the syncs' own

Weights version v = the rollout steps trained into them. Transports, one file each
(services/driver/transports/, picked once from ``trainer.weight_sync.transport``;
JobConfig.weight_transport resolves ``auto``):

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
from typing import Any

import ray

from services.driver.transports import WeightTransport, transport_for

__all__ = ["WeightSync", "WeightTransport", "transport_for"]


class WeightSync:
    def __init__(self, transport: WeightTransport, fetch: Callable[[Any, str], Any]) -> None:
        """``fetch(ref, verb)``: a load's answer within the rollout call timeout."""
        self.transport, self.fetch = transport, fetch
        self.pending: list[Any] = []

    def start(self, version: int) -> dict[str, float]:
        """Send now; the engines load in the manager's order while the driver goes on.
        Returns the sync's metrics (time, bytes, peak memory per rank)."""
        load, metrics = self.transport.send_weights(version)
        self.pending.append(load)
        return metrics

    def follow(self, load: Any) -> None:
        """Also wait for ``load``, a load of the current weights started elsewhere (a lost
        engine's replacement: ``manager.replace_engine``), as for the syncs' own."""
        self.pending.append(load)

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
