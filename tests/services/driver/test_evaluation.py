"""Evaluation metrics: the unbiased pass@k estimator against brute-force enumeration,
greedy accuracy per difficulty, the schedule, and the config's refusals."""

from __future__ import annotations

import itertools

import pytest

from rollout.manager import EvalOutcome
from services.config import ConfigError, EvalConfig, parse_job_config
from services.evaluation import eval_metrics, is_eval_step, pass_at_k


@pytest.mark.parametrize(("n", "c", "k"), [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3),
                                           (6, 5, 2), (3, 3, 3), (8, 3, 8)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one(n, c, k) -> None:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    expected = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


def outcome(greedy: float, samples: list[float], difficulty: int) -> EvalOutcome:
    return EvalOutcome({"difficulty": difficulty}, greedy, 7, samples)


def test_accuracy_pass_at_k_and_levels() -> None:
    config = EvalConfig(enabled=True, num_samples=2, k=1)
    metrics = eval_metrics([outcome(1.0, [1.0, 0.0], 1), outcome(0.0, [0.0, 0.0], 1),
                            outcome(0.0, [1.0, 1.0], 2), outcome(0.5, [0.5, 1.0], 2)], config)
    assert metrics["eval/accuracy"] == 0.25  # 0.5 is below correct_reward 1.0
    assert metrics["eval/pass@k"] == pytest.approx((0.5 + 0 + 1 + 0.5) / 4)
    assert metrics["eval/k"] == 1.0
    assert (metrics["eval/accuracy/d1"], metrics["eval/accuracy/d2"]) == (0.5, 0.0)
    assert metrics["eval/reward_mean"] == pytest.approx(0.375)


def test_schedule_runs_before_the_first_step_every_n_and_at_the_last() -> None:
    config = EvalConfig(enabled=True, every_steps=4)
    assert [s for s in range(10) if is_eval_step(s, 10, config)] == [0, 4, 8, 9]
    assert not any(is_eval_step(s, 10, EvalConfig()) for s in range(10))


def test_config_names_what_is_wrong() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_job_config("eval: {enabled: true, num_samples: 4, k: 5, dataset: {type: "
                         "synthetic}}")
    (problem,) = refused.value.problems
    assert problem.field == "eval.k" and "pass@5 needs at least 5 samples" in problem.message
    with pytest.raises(ConfigError) as refused:
        parse_job_config("eval: {enabled: true}")
    (problem,) = refused.value.problems
    assert problem.field == "eval.dataset" and "has no held-out split" in problem.message
    config = parse_job_config("eval: {enabled: true, dataset: {type: synthetic, seed: 7}}")
    assert config.eval_dataset().seed == 7
