"""When PPO's policy starts to train: the critic's warm-up (``critic.warmup_steps``,
``critic.warmup_until_explained_variance``).

During the warm-up only the critic steps; the policy neither steps nor advances its
learning-rate schedule (its scheduler moves with its own optimizer steps only). The
policy starts at rollout step s when

    s ≥ warmup_steps                                   without a threshold
    ev_s ≥ threshold  or  (warmup_steps > 0 and s ≥ warmup_steps)   with one

where ev_s is rollout s's ``critic/explained_variance`` (of V at the rollout, before
the critic's updates on it: how well the critic predicts returns it has not trained
on). Once started it trains every later rollout, whatever the explained variance does.
Every row of a job with a critic logs ``critic/policy_waiting`` (1 during the warm-up,
0 after), which is also how a resumed job knows the policy had started.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

EXPLAINED_VARIANCE = "critic/explained_variance"
WAITING = "critic/policy_waiting"
"""The row's metric: 1 while the policy waits for the critic, 0 once it trains."""


@dataclass
class CriticWarmup:
    """The module docstring's rule, with its one bit of state (``started``)."""

    warmup_steps: int = 0
    until_explained_variance: float | None = None
    started: bool = False

    def policy_trains(self, step: int, explained_variance: float | None) -> bool:
        """Whether the policy steps on rollout ``step`` (its ``explained_variance``, None
        when none was computed); once True, True for good."""
        if not self.started:
            if self.until_explained_variance is None:
                self.started = step >= self.warmup_steps
            else:
                bounded = self.warmup_steps > 0 and step >= self.warmup_steps
                reached = (explained_variance is not None
                           and explained_variance >= self.until_explained_variance)
                self.started = bounded or reached
        return self.started

    def restore(self, rows: Iterable[Mapping[str, float]]) -> None:
        """After a resume: started if any kept row (steps up to the checkpoint) says the
        policy trained."""
        self.started = any(row.get(WAITING) == 0.0 for row in rows)
