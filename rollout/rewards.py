r"""Rewards: score decoded responses against their labels.

Every reward function is batched and has one signature::

    fn(responses: list[str], labels: list[str | None], metadata: list[dict]) -> list[float]

(a custom one may be ``async def``). Built-ins score 1.0 for a match and 0.0 otherwise:

    exact_match  response.strip() == label.strip()
    numeric      the last number in the response equals float(label), |a−b| ≤ tol·max(1, |b|)
    boxed        the content of the last \boxed{…} equals the label (numerically if both parse)

A sample whose reward raises (or returns a non-finite value) gets
``default_on_error`` and counts as an error; a custom function that raises on its batch
is retried sample by sample so one bad sample does not sink its neighbours. The caller
fails the step with :class:`RewardError` once errors exceed ``max_error_rate``
(:func:`check_error_rate`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout.config import RewardConfig
from rollout.plugins import PluginError, load_object

RewardFn = Callable[[list[str], list[str | None], list[dict[str, Any]]], Any]
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class RewardError(RuntimeError):
    """Rewards failed: too many errors in a step, or an unusable reward function."""


@dataclass(frozen=True)
class RewardResult:
    """Rewards of one batch of responses, and how many of them fell back on error."""

    rewards: list[float]
    num_errors: int = 0
    first_error: str | None = None


def _require_label(label: str | None) -> str:
    if label is None:
        raise ValueError("this reward needs a label, but the record has none")
    return label


def _parse_number(text: str) -> float | None:
    matches = _NUMBER.findall(text.replace(",", ""))
    return float(matches[-1]) if matches else None


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{…}``, braces balanced; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 1, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None  # unbalanced: the response was cut off inside the box


def _numbers_equal(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * max(1.0, abs(b))


def exact_match(
    responses: list[str], labels: list[str | None], metadata: list[dict]
) -> list[float]:
    return [
        float(r.strip() == _require_label(lb).strip())
        for r, lb in zip(responses, labels, strict=True)
    ]


def numeric_match(
    responses: list[str], labels: list[str | None], metadata: list[dict], tolerance: float = 1e-6
) -> list[float]:
    rewards = []
    for response, label in zip(responses, labels, strict=True):
        target = float(_require_label(label).replace(",", ""))  # a bad label raises: an error
        value = _parse_number(response)
        rewards.append(float(value is not None and _numbers_equal(value, target, tolerance)))
    return rewards


def boxed_match(
    responses: list[str], labels: list[str | None], metadata: list[dict], tolerance: float = 1e-6
) -> list[float]:
    rewards = []
    for response, label in zip(responses, labels, strict=True):
        target = _require_label(label).strip()
        boxed = extract_boxed(response)
        if boxed is None:
            rewards.append(0.0)
            continue
        boxed = boxed.strip().strip("$").strip()
        a, b = _parse_number(boxed), _parse_number(target)
        if a is not None and b is not None and _NUMBER.fullmatch(boxed.replace(",", "")):
            rewards.append(float(_numbers_equal(a, b, tolerance)))
        else:
            rewards.append(float(boxed == target))
    return rewards


def load_custom_function(path: str) -> RewardFn:
    """Import ``module:function``; errors say what is wrong with the path."""
    try:
        return load_object(path, "reward.custom_function")
    except PluginError as err:
        raise RewardError(str(err)) from err


def reward_function(config: RewardConfig) -> RewardFn:
    """The batched reward function a config selects."""
    tolerance = config.numeric_tolerance
    if config.type == "exact_match":
        return exact_match
    if config.type == "numeric":
        return lambda r, lb, m: numeric_match(r, lb, m, tolerance)
    if config.type == "boxed":
        return lambda r, lb, m: boxed_match(r, lb, m, tolerance)
    assert config.custom_function is not None  # guaranteed by RewardConfig
    return load_custom_function(config.custom_function)


def _call(fn: RewardFn, responses: list[str], labels: list, metadata: list[dict]) -> list[float]:
    result = fn(responses, labels, metadata)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    rewards = [float(x) for x in result]
    if len(rewards) != len(responses):
        raise RewardError(f"returned {len(rewards)} rewards for {len(responses)} responses")
    return rewards


async def _await(awaitable: Any) -> Any:
    return await awaitable


class RewardScorer:
    """Scores batches with the configured function, isolating per-sample failures."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.fn = reward_function(config)

    def score(
        self, responses: list[str], labels: list[str | None], metadata: list[dict[str, Any]]
    ) -> RewardResult:
        try:
            rewards = _call(self.fn, responses, labels, metadata)
        except RewardError as e:
            raise RewardError(f"reward: {self.config.type} reward function {e}") from e
        except Exception:
            rewards = None  # find the failing samples one by one
        if rewards is not None and all(math.isfinite(r) for r in rewards):
            return RewardResult(rewards)
        out, num_errors, first_error = [], 0, None
        for i, (response, label, meta) in enumerate(zip(responses, labels, metadata, strict=True)):
            try:
                value = _call(self.fn, [response], [label], [meta])[0]
                if not math.isfinite(value):
                    raise ValueError(f"non-finite reward {value}")
            except Exception as e:
                value, num_errors = self.config.default_on_error, num_errors + 1
                first_error = first_error or f"sample {i}: {type(e).__name__}: {e}"
            out.append(value)
        return RewardResult(out, num_errors, first_error)


def check_error_rate(
    num_errors: int, num_samples: int, config: RewardConfig, step: int, first_error: str | None
) -> None:
    """Raise RewardError when a step's reward errors exceed ``reward.max_error_rate``."""
    if num_samples and num_errors / num_samples > config.max_error_rate:
        raise RewardError(
            f"reward: {num_errors} of {num_samples} samples in step {step} raised "
            f"({num_errors / num_samples:.1%}), above reward.max_error_rate="
            f"{config.max_error_rate}; first error: {first_error}"
        )
