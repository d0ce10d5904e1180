"""A reward function that raises on every batch: a job scored by it fails for good in its
first rollout step (every sample raised: above reward.max_error_rate)."""

from __future__ import annotations

PLANTED = "the planted reward failure"


def always_raises(responses: list[str], labels: list, metadata: list[dict]) -> list[float]:
    raise ValueError(PLANTED)
