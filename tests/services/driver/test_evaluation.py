"""Evaluation metrics: the unbiased pass@k estimator against brute-force enumeration,
greedy accuracy per difficulty, the schedule, the config's refusals, an async evaluation
never waited for, and training's random stream untouched by evaluations."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import ray

from rollout.manager import EvalOutcome, EvalRun
from rollout.sample_record import SampleRecord
from services.config.job import ConfigError, parse_job_config
from services.driver.config import EvalConfig
from services.driver.evaluation import (
    Evaluation,
    eval_metrics,
    is_eval_version,
    pass_at_k,
)
from tests.services.driver.clean_run import CleanRun, assert_same_training, clean_config, rows


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


def test_each_reward_part_is_averaged_over_the_greedy_responses() -> None:
    def record(rewards: dict[str, float], greedy: bool) -> SampleRecord:
        return SampleRecord(step=0, group=0, prompt="", record_prompt="", response="",
                            label=None, reward=sum(rewards.values()), rewards=rewards,
                            greedy=greedy)

    def scored(correct: float, rm: float) -> EvalOutcome:
        greedy = record({"correct": correct, "rm": rm}, True)
        sampled = record({"correct": 9.0, "rm": 9.0}, False)
        return EvalOutcome({}, 0.1 * rm, 3, [9.0], [greedy, sampled])

    config = EvalConfig(enabled=True, num_samples=1, k=1)
    metrics = eval_metrics([scored(1.0, 2.0), scored(0.0, 4.0)], config)
    assert metrics["eval/reward/correct/mean"] == 0.5
    assert metrics["eval/reward/rm/mean"] == 3.0
    one_part = eval_metrics([EvalOutcome({}, 1.0, 3, [1.0], [record({"boxed": 1.0}, True)])],
                            config)
    assert not [k for k in one_part if k.startswith("eval/reward/")]


def test_schedule_evaluates_the_start_every_n_and_the_final_trained_weights() -> None:
    config = EvalConfig(enabled=True, every_steps=4)
    # Weight versions 0..10 (10: after the last of 10 rollout steps). Version 9, the start
    # of the last step, is left to the final weights, which share its row.
    assert [v for v in range(11) if is_eval_version(v, 10, config)] == [0, 4, 8, 10]
    assert [v for v in range(10) if is_eval_version(v, 9, config)] == [0, 4, 9]
    assert [v for v in range(2) if is_eval_version(v, 1, config)] == [1]
    assert not any(is_eval_version(v, 10, EvalConfig()) for v in range(11))


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


@ray.remote(num_cpus=0)
class HeldManager:
    """Stands in the rollout manager's place as a real actor whose evaluate answers only
    once released: an evaluation queued behind rollouts still being generated."""

    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True

    def evaluate(self, version: int) -> EvalRun:
        while not self.released:
            time.sleep(0.01)
        return EvalRun(version, [EvalOutcome({}, 1.0, 3, [1.0, 0.0])])


def test_an_async_evaluation_is_collected_when_done_never_waited_for(
        ray_cluster: None) -> None:
    manager = HeldManager.options(max_concurrency=3).remote()  # 2 held + release
    recorded: list[tuple[int, dict[str, float]]] = []
    evaluation = Evaluation(EvalConfig(enabled=True, every_steps=1, num_samples=2), 3,
                            manager.evaluate.remote, lambda ref: ray.get(ref, timeout=30),
                            lambda ref: bool(ray.wait([ref], timeout=0)[0]),
                            lambda version, row: recorded.append((version, row)))
    evaluation.start(version=0)
    evaluation.start(version=1)
    assert evaluation.collect(wait=False) == {}  # the driver goes on to train
    assert recorded == []
    ray.get(manager.release.remote())
    row = evaluation.collect(wait=True)
    assert row["eval/weight_version"] == 1.0 and row["eval/accuracy"] == 1.0
    assert [version for version, _ in recorded] == [0, 1]  # every result kept, in order
    assert row["eval/pass@k"] == pytest.approx(1.0)


@pytest.mark.slow  # a job besides the clean run
@pytest.mark.usefixtures("warm_gang_pool")
def test_evaluation_leaves_what_training_samples_and_trains_untouched(
        clean_run: CleanRun, tmp_path: Path) -> None:
    """The clean job evaluated at every weight version: its evaluations are queued in the
    same manager, on the same engines, between the rollouts; what it trains — every
    metrics and updates row but the eval ones, the final weights — is the clean run's,
    bit for bit. `tally eval` of its last checkpoint measures what the job's own last
    evaluation did (the same weights, seeds and prompts)."""
    from typer.testing import CliRunner

    from services.cli import app
    from services.driver.loop import run_job
    from tests.services.driver.clean_run import CLEAN, ROOT

    evaluate = ["eval.enabled=true", "eval.every_steps=1", "eval.num_prompts=8",
                "eval.num_samples=2",
                "eval.dataset={type: synthetic, task: copy, difficulty: 1, seed: 7}"]
    config = clean_config(*evaluate)
    history = run_job(config, tmp_path / "job", log=lambda *_: None)
    evaluated = rows(tmp_path / "job" / "eval.jsonl")
    assert [r["step"] for r in evaluated] == [0, 1, 2, 4]
    assert [r["metrics"]["eval/weight_version"] for r in evaluated] == [0.0, 1.0, 2.0, 4.0]
    # Collected when done, never waited for, except the final weights': in the last row.
    assert history[-1]["eval/weight_version"] == 4.0
    assert history[-1]["eval/accuracy"] == evaluated[-1]["metrics"]["eval/accuracy"]
    assert_same_training(tmp_path / "job", clean_run, ignore=("eval/",))

    result = CliRunner().invoke(app, [
        "eval", str(tmp_path / "job" / "checkpoints" / "latest"), "--config",
        str(ROOT / "configs" / "demo.yaml"),
        *[arg for value in [*CLEAN, *evaluate] for arg in ("--set", value)]])
    assert result.exit_code == 0, result.output
    printed = dict(line.split() for line in result.output.splitlines())
    want = evaluated[-1]["metrics"]
    assert set(printed) == {k for k in want if k != "perf/eval_s"}, printed
    for name, value in printed.items():
        assert float(value) == pytest.approx(want[name], abs=1e-4), name
