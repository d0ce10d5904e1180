"""The rollouts in flight ahead of training (``rollout.async_steps`` = k).

    step s:  ask for rollouts s … s+k not asked for yet ──► manager queue (in order)
             take rollout s (wait) ──► train ──► weights v = s+1 to the engines

The manager answers in order, each rollout from the weights it holds when it starts, and
a weight load queues behind the rollouts asked for before it. So rollout s is generated
from the weights of step s − k at the oldest (``rollout/staleness`` ≤ k) and a run is
reproducible: what is in flight depends only on k, never on timing. A checkpoint keeps
the rollouts in flight (:meth:`RolloutPipeline.state_dict`), so a resume trains on the
same samples instead of regenerating them from newer weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.batch import RolloutBatch

WALL_CLOCK_METADATA = ("rollout/gen_start_time", "rollout/gen_end_time")
"""Batch metadata that is a moment, not a measure: used for perf/gen_overlap, not logged."""


class RolloutPipeline:
    """Rollouts asked for, rollouts restored from a checkpoint, and the trainer's busy
    windows (for the share of generation hidden behind training)."""

    def __init__(self, ask: Callable[[int], Any], fetch: Callable[[Any], RolloutBatch],
                 lookahead: int, num_steps: int) -> None:
        """``ask(step)``: a reference to that step's rollout (the manager's call);
        ``fetch(ref)``: the rollout, waited for within the rollout call timeout."""
        self.ask, self.fetch = ask, fetch
        self.lookahead, self.num_steps = lookahead, num_steps
        self.in_flight: dict[int, Any] = {}
        self.restored: dict[int, RolloutBatch] = {}
        self.train_windows: dict[int, tuple[float, float]] = {}

    def take(self, step: int, lookahead: int | None = None) -> tuple[RolloutBatch, Any]:
        """Step ``step``'s rollout (waiting for it) and its object-store ref (None for a
        restored one), after asking for the next ``lookahead`` (default k) steps'."""
        ahead = self.lookahead if lookahead is None else lookahead
        for later in range(step, min(step + ahead, self.num_steps - 1) + 1):
            if later not in self.in_flight and later not in self.restored:
                self.in_flight[later] = self.ask(later)
        if step in self.restored:
            return self.restored.pop(step), None
        ref = self.in_flight.pop(step)
        return self.fetch(ref), ref

    def trained(self, step: int, window: tuple[float, float]) -> None:
        """Step ``step`` trained from ``window[0]`` to ``window[1]`` (wall clock)."""
        self.train_windows = {s: w for s, w in self.train_windows.items()
                              if s >= step - self.lookahead}
        self.train_windows[step] = window

    def metrics(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """``rollout/staleness``: how many weight versions older than this step's the
        rollout's weights were (0 synchronous, ≤ k); ``perf/gen_overlap``: the share of
        its generation time that ran while the trainer computed."""
        start = batch.metadata["rollout/gen_start_time"]
        end = batch.metadata["rollout/gen_end_time"]
        hidden = sum(max(0.0, min(end, t1) - max(start, t0))
                     for t0, t1 in self.train_windows.values())
        return {"rollout/staleness": step - batch.metadata["rollout/weight_version"],
                "perf/gen_overlap": hidden / max(end - start, 1e-9)}

    def state_dict(self) -> dict[int, RolloutBatch]:
        """Every rollout in flight, waited for: what a checkpoint keeps (the refs stay, so
        the trainer still reads each from the object store)."""
        return {**self.restored,
                **{step: self.fetch(ref) for step, ref in self.in_flight.items()}}

    def load_state_dict(self, rollouts: dict[int, RolloutBatch]) -> None:
        self.restored = dict(rollouts)
