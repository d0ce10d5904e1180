"""Built-in and custom rewards, per-sample error isolation, the error-rate limit."""

from __future__ import annotations

import re

import pytest

from rollout.config import RewardConfig
from rollout.rewards import RewardError, RewardScorer, check_error_rate, extract_boxed

HERE = "tests.rollout.reward_fns"


def _score(config: RewardConfig, responses: list[str], labels: list) -> list[float]:
    result = RewardScorer(config).score(responses, labels, [{} for _ in responses])
    assert result.num_errors == 0, result.first_error
    return result.rewards


def test_builtin_rewards() -> None:
    exact = RewardConfig(type="exact_match")
    assert _score(exact, [" cba\n", "cb", "CBA"], ["cba", "cba", "cba"]) == [1.0, 0.0, 0.0]
    numeric = RewardConfig(type="numeric")
    responses = ["so 19", "it is 1,000.0", "-3 then 4", "none", "2e3"]
    assert _score(numeric, responses, ["19", "1000", "-3", "1", "2000"]) == [1, 1, 0, 0, 1]
    boxed = RewardConfig(type="boxed")
    responses = ["\\boxed{1} no \\boxed{ 42 }", "\\boxed{\\frac{1}{2}}", "\\boxed{7", "42"]
    assert _score(boxed, responses, ["42.0", "\\frac{1}{2}", "7", "42"]) == [1, 1, 0, 0]
    assert extract_boxed("a \\boxed{x{y}z} b") == "x{y}z"
    assert extract_boxed("no box") is None


def test_custom_sync_and_async_functions() -> None:
    for name in ("length_reward", "async_length_reward"):
        config = RewardConfig(type="custom", custom_function=f"{HERE}:{name}")
        assert _score(config, ["ab", "abcd"], [None, None]) == [2.0, 4.0]


def test_failing_samples_get_default_and_are_counted() -> None:
    config = RewardConfig(
        type="custom", custom_function=f"{HERE}:fails_on_x", default_on_error=-1.0
    )
    result = RewardScorer(config).score(["a", "x", "b", "xx"], [None] * 4, [{}] * 4)
    assert result.rewards == [1.0, -1.0, 1.0, -1.0]
    assert result.num_errors == 2
    assert result.first_error == "sample 1: ValueError: cannot score an x"
    # A builtin without a label fails per sample, too.
    result = RewardScorer(RewardConfig()).score(["a", "b"], ["a", None], [{}, {}])
    assert result.rewards == [1.0, 0.0] and result.num_errors == 1
    assert "needs a label" in (result.first_error or "")


def test_error_rate_limit_message() -> None:
    config = RewardConfig(max_error_rate=0.25)
    check_error_rate(1, 4, config, step=3, first_error="boom")  # exactly at the limit: fine
    with pytest.raises(RewardError) as info:
        check_error_rate(2, 4, config, step=3, first_error="sample 1: ValueError: boom")
    assert str(info.value) == (
        "reward: 2 of 4 samples in step 3 raised (50.0%), above reward.max_error_rate=0.25; "
        "first error: sample 1: ValueError: boom"
    )


def test_unusable_custom_functions() -> None:
    with pytest.raises(
        RewardError, match=r"reward\.custom_function: cannot import module 'nope_x'"
    ):
        RewardScorer(RewardConfig(type="custom", custom_function="nope_x:f"))
    with pytest.raises(RewardError, match=re.escape(f"module '{HERE}' has no callable 'missing'")):
        RewardScorer(RewardConfig(type="custom", custom_function=f"{HERE}:missing"))
    scorer = RewardScorer(RewardConfig(type="custom", custom_function=f"{HERE}:wrong_length"))
    with pytest.raises(RewardError, match="custom reward function returned 1 rewards for 2"):
        scorer.score(["a", "b"], [None, None], [{}, {}])
