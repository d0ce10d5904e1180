"""The trainer's weights to the rollout engines, once per rollout step.

    WeightSync.start(v):  ranks export (collective, bounded by trainer.call_timeout_s; a
                          dead rank raises TrainerRankDied and the job restarts) ──►
                          manager.update_weights([ref], v), queued behind the rollouts
                          already asked for (services/driver/pipeline.py)
    WeightSync.poll():    a load that finished with an error raises here
    WeightSync.wait():    every load started is done (before an evaluation is read, a
                          checkpoint, the end)

Weights version v = the rollout steps trained into them. The transport is the trainer's
export: on CPU, numpy arrays in Ray's object store, read in place by an engine on the same
node; the GPU transports (NCCL broadcast to SGLang, CUDA IPC) plug in behind ``start``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray


class WeightSync:
    def __init__(self, export: Callable[[], Any], load: Callable[[Any, int], Any],
                 fetch: Callable[[Any, str], Any]) -> None:
        """``export()``: the ranks' exported weights, a reference (waited for);
        ``load(ref, version)``: the manager's update call, a reference; ``fetch(ref,
        verb)``: its answer within the rollout call timeout."""
        self.export, self.load, self.fetch = export, load, fetch
        self.pending: list[Any] = []

    def start(self, version: int) -> None:
        """Export now; the engines load in the manager's order while the driver goes on."""
        self.pending.append(self.load([self.export()], version))

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
