"""Custom reward parts the tests name by ``class_path`` (rollout/reward_parts/custom.py)."""

from __future__ import annotations

from typing import Any

from rollout.reward_parts import CustomReward


class ExactMatch(CustomReward):
    """``type: exact_match`` written by a user: 1.0 when the stripped response equals
    the stripped label; a sample without a label is unscorable (None)."""

    def __init__(self, strip: bool = True) -> None:
        self.strip = strip

    def score(self, prompts: list[Any], responses: list[str], labels: list[str | None],
              metadata: list[dict[str, Any]]) -> list[float | None]:
        def norm(text: str) -> str:
            return text.strip() if self.strip else text

        return [None if label is None else float(norm(r) == norm(label))
                for r, label in zip(responses, labels, strict=True)]


class ShortFor(CustomReward):
    """``kwargs``-configured: 1 for a response of at most ``limit`` characters."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def score(self, prompts: list[Any], responses: list[str], labels: list[str | None],
              metadata: list[dict[str, Any]]) -> list[float | None]:
        return [float(len(r) <= self.limit) for r in responses]


class NotFinite(CustomReward):
    def score(self, prompts: list[Any], responses: list[str], labels: list[str | None],
              metadata: list[dict[str, Any]]) -> list[float | None]:
        return [float("nan")] * len(responses)


class NotAReward:
    """Has a score method but does not subclass CustomReward."""

    def score(self, prompts: list[Any], responses: list[str], labels: list[str | None],
              metadata: list[dict[str, Any]]) -> list[float | None]:
        return [0.0] * len(responses)


def a_function(responses: list[str], labels: list, metadata: list[dict]) -> list[float]:
    return [0.0] * len(responses)
