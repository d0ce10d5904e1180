"""Environments the tests load through `module:Class` paths: each behaves in one way the
episode loop must handle (answers, async, slow, raising, malformed)."""

from __future__ import annotations

import asyncio
import threading
import time

from rollout.environments import Environment


class Countdown(Environment):
    """Answers every action with ``obs<k>`` and is done after ``turns`` steps; each step
    rewards 0.25, so an episode's reward tells how many steps it took."""

    def __init__(self, turns: int = 3, reward: float = 0.25) -> None:
        self.turns, self.reward, self.taken = turns, reward, 0
        self.actions: list[str] = []
        self.tool_calls = 0
        """Counted like a tool's calls: each step but the last."""

    def reset(self, record: dict) -> str:
        return f"start {record['label']}:"

    def step(self, action: str) -> tuple[str | None, float, bool]:
        self.taken += 1
        self.actions.append(action)
        done = self.taken >= self.turns
        self.tool_calls += not done
        return (None if done else f"obs{self.taken}:"), self.reward, done


RELEASE = threading.Event()
"""Set by a test to let every BlocksOnStep call return."""


class BlocksOnStep(Countdown):
    """Countdown whose step waits until RELEASE is set (at most ``seconds``): a hung tool."""

    def __init__(self, seconds: float = 60.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.seconds = seconds

    def step(self, action: str) -> tuple[str | None, float, bool]:
        RELEASE.wait(self.seconds)
        return super().step(action)


class AsyncCountdown(Countdown):
    """Countdown with ``async def`` reset and step (each awaits a little)."""

    async def reset(self, record: dict) -> str:  # type: ignore[override]
        await asyncio.sleep(0.01)
        return super().reset(record)

    async def step(self, action: str) -> tuple[str | None, float, bool]:  # type: ignore[override]
        await asyncio.sleep(0.01)
        return super().step(action)


class SlowOnLabel(Countdown):
    """Countdown whose step sleeps ``seconds`` for records labelled ``slow``."""

    def __init__(self, seconds: float = 5.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.seconds, self.slow = seconds, False

    def reset(self, record: dict) -> str:
        self.slow = record["label"] == "slow"
        return super().reset(record)

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if self.slow:
            time.sleep(self.seconds)
        return super().step(action)


class AsyncSlowOnLabel(SlowOnLabel):
    """SlowOnLabel whose slow step awaits (an asyncio timeout cancels it)."""

    async def step(self, action: str) -> tuple[str | None, float, bool]:  # type: ignore[override]
        if self.slow:
            await asyncio.sleep(self.seconds)
        return Countdown.step(self, action)


class RaisesOnLabel(Countdown):
    """Countdown that raises in reset for ``reset`` records, in its second step for
    ``step`` records, and returns a malformed step result for ``malformed`` ones."""

    def reset(self, record: dict) -> str:
        self.label = record["label"]
        if self.label == "reset":
            raise KeyError("no such board")
        return super().reset(record)

    def step(self, action: str) -> tuple[str | None, float, bool]:
        result = super().step(action)
        if self.label == "step" and self.taken == 2:
            raise ValueError("the tool crashed")
        if self.label == "malformed":
            return ("only two", 1.0)  # type: ignore[return-value]
        return result


class Chatty(Environment):
    """Answers with a long text, so the episode's token budget ends it."""

    def __init__(self, words: int = 50) -> None:
        self.words = words

    def reset(self, record: dict) -> str:
        return "talk:"

    def step(self, action: str) -> tuple[str | None, float, bool]:
        return " ".join(["blah"] * self.words), 1.0, False
