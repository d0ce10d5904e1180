"""GuessNumber: find a secret whole number in [low, high], told "higher" or "lower".

    secret  int(label) when the record's label is a whole number in [low, high], else
            low + int(sha256(prompt text)) mod (high − low + 1)   (chat prompts as JSON)
    step    the last whole number of the action is the guess:
              none         -> a reminder of the answer format, 0
              guess = secret -> (None, 1, done)
              otherwise    -> "Your guess g is too low / too high. ...", 0

No tools and no randomness: the secret is a function of the record, so a resumed run
replays every episode. Binary search needs at most ⌊log2(high − low + 1)⌋ + 1 guesses
(5 for 1..16), so max_turns of 5 or more leaves room to win every game.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from rollout.environments import Environment

_INTEGER = re.compile(r"-?\d+")


class GuessNumber(Environment):
    """One game of guessing a secret number (see the module doc)."""

    def __init__(self, low: int = 1, high: int = 16) -> None:
        if low > high:
            raise ValueError(f"GuessNumber: low ({low}) must not exceed high ({high})")
        self.low, self.high = low, high
        self._secret: int | None = None

    def reset(self, record: dict[str, Any]) -> str:
        self._secret = secret_of(record, self.low, self.high)
        return (f"I am thinking of a whole number between {self.low} and {self.high}. "
                "Guess it! After each guess I will tell you whether the secret number is "
                "higher or lower. Answer with just the number.")

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if self._secret is None:
            raise RuntimeError("GuessNumber.step before reset")
        numbers = _INTEGER.findall(action)
        if not numbers:
            return (f"Answer with a single whole number between {self.low} and "
                    f"{self.high}.", 0.0, False)
        guess = int(numbers[-1])
        if guess == self._secret:
            return None, 1.0, True
        if guess < self._secret:
            return f"Your guess {guess} is too low. The secret number is higher.", 0.0, False
        return f"Your guess {guess} is too high. The secret number is lower.", 0.0, False


def secret_of(record: dict[str, Any], low: int, high: int) -> int:
    """The record's label when it is a whole number in [low, high]; else a hash of its
    prompt mapped into [low, high] (sha256: the same on every machine and process)."""
    label = record.get("label")
    try:
        value = int(str(label).strip())
    except ValueError:
        value = None
    if value is not None and low <= value <= high:
        return value
    prompt = record.get("prompt", "")
    text = prompt if isinstance(prompt, str) else json.dumps(
        prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    digest = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return low + digest % (high - low + 1)
