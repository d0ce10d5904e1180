"""Admission by what the cluster can hold, not only by ``max_running_jobs``.

    free = min(total - used,  total - Σ needs of the jobs already admitted)

``used`` is Ray's (every placement group, ours or not); the second term counts the jobs we
admitted (and the live training sessions) whose placement group Ray has not reserved yet.
Queued jobs and sessions go in one order; the first that does not fit waits (and says
so) and holds the queue, so a big one is never starved by small ones; one that cannot fit
even an empty cluster is refused, so it never blocks the others.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.runtime.placement import describe_shortfall

Resources = dict[str, float]


def _sum(needs: Iterable[Resources]) -> Resources:
    total: Resources = {}
    for need in needs:
        for name, amount in need.items():
            total[name] = total.get(name, 0.0) + amount
    return total


class Capacity:
    def __init__(self, usage: dict[str, tuple[float, float]] | None,
                 admitted: Iterable[Resources]) -> None:
        """``usage``: (used, total) per resource, as Ray reports it; None: unknown (every
        job fits, as before)."""
        self.known = usage is not None
        self.total = {name: total for name, (_, total) in (usage or {}).items()}
        reserved = _sum(admitted)
        self.free = {name: min(total - used, total - reserved.get(name, 0.0))
                     for name, (used, total) in (usage or {}).items()}

    def _fits(self, needs: Resources, have: Resources) -> bool:
        return all(amount <= have.get(name, 0.0) + 1e-9 for name, amount in needs.items())

    def never_fits(self, needs: Resources) -> bool:
        return self.known and not self._fits(needs, self.total)

    def shortfall(self, needs: Resources) -> str | None:
        """None if the job fits now; else the 'waiting for resources: ...' message."""
        if not self.known or self._fits(needs, self.free):
            return None
        if self.never_fits(needs):
            return describe_shortfall(needs, self.total, "in all")
        return describe_shortfall(needs, {k: max(v, 0.0) for k, v in self.free.items()})

    def take(self, needs: Resources) -> None:
        for name, amount in needs.items():
            self.free[name] = self.free.get(name, 0.0) - amount
