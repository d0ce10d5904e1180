"""Custom reward functions the tests load through `module:function` paths."""

from __future__ import annotations


def length_reward(responses: list[str], labels: list, metadata: list[dict]) -> list[float]:
    return [float(len(r)) for r in responses]


async def async_length_reward(responses: list[str], labels: list, metadata: list[dict]) -> list:
    return [float(len(r)) for r in responses]


def fails_on_x(responses: list[str], labels: list, metadata: list[dict]) -> list[float]:
    """Raises whenever a response in the batch contains 'x' (the scorer retries per sample)."""
    if any("x" in r for r in responses):
        raise ValueError("cannot score an x")
    return [1.0] * len(responses)


def wrong_length(responses: list[str], labels: list, metadata: list[dict]) -> list[float]:
    return [0.0]


def spread_unless_flat(responses: list[str], labels: list, metadata: list[dict]) -> list[float]:
    """0 for every sample of a `flat` record; otherwise 1 when the response's first
    character has an even code point (about half of the tiny model's draws), so a group
    of 4 such samples has reward spread 7 times in 8."""
    return [
        0.0 if meta.get("flat") else float(r[:1] != "" and ord(r[0]) % 2 == 0)
        for r, meta in zip(responses, metadata, strict=True)
    ]
