"""On-policy distillation end to end on real Ray: a weak student (half the warm start)
distilled from a trained teacher (the demo's warm start) through the whole driver —
teacher actors in the job's gang, per-token advantages, the reverse KL logged — moves
toward the teacher: the reverse KL falls and its greedy accuracy rises toward the
teacher's."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.manager import RolloutManager
from services.config.job import load_job_config
from services.driver.evaluation import eval_metrics
from services.driver.job import job_model_path
from services.driver.loop import run_job
from services.runtime.gang import start_rollout_actors
from tests.services.test_train import ROOT

EVAL = ["eval.enabled=true", "eval.every_steps=75", "eval.num_prompts=32",
        "eval.num_samples=1", "eval.dataset={type: synthetic, task: copy, difficulty: 1, seed: 7}"]


@pytest.mark.slow  # a warm start of 40 steps, then 150 distilled steps of 64 samples
def test_a_weak_student_distilled_from_a_trained_teacher_moves_toward_it(
        ray_cluster: None, tmp_path: Path) -> None:
    teacher_config = load_job_config(ROOT / "configs" / "demo.yaml", EVAL)
    teacher = job_model_path(teacher_config, log=lambda _: None)  # the demo's warm start
    config = load_job_config(ROOT / "configs" / "demo.yaml", [
        *EVAL, "warmup.num_steps=40", "num_steps=150", "rollout.global_batch_size=64",
        "trainer.dp_size=1", "trainer.optimizer.schedule=constant",
        "trainer.loss.entropy_coef=0.0", "rollout.advantage={type: distill, teacher: "
        f"{teacher}}}"])
    history = run_job(config, tmp_path / "job", log=lambda *_: None)

    actors = start_rollout_actors(teacher_config.rollout, teacher)  # evaluated alike
    manager = RolloutManager(teacher_config.rollout, teacher, engines=actors.engines,
                             owns_engines=True, teachers=actors.teachers,
                             reward_actors=actors.reward_actors)
    try:
        run = manager.evaluate(config.eval_dataset(), 32, 1, 1.0, 0)
    finally:
        manager.shutdown()
    target = eval_metrics(run.outcomes, config.eval)["eval/accuracy"]
    start, end = history[0]["eval/accuracy"], history[-1]["eval/accuracy"]
    assert (history[0]["eval/weight_version"], history[-1]["eval/weight_version"]) == (0, 150)
    assert start < target - 0.2, (start, target)  # the premise: a weaker student
    assert end > start + 0.1 and abs(target - end) < abs(target - start), (start, end, target)
    kl = [row["distill/reverse_kl"] for row in history]
    assert sum(kl[-5:]) / 5 < 0.5 * sum(kl[:5]) / 5, kl
    assert all(row["perf/teacher_s"] > 0 for row in history)
