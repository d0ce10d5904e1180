"""A user's model on a real task: one RL step and one evaluation of SmolLM2-135M-Instruct
on the math word problems, through the whole driver (real Ray, the real BPE tokenizer and
chat template, pad == eos), kept small enough for CI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.config.job import load_job_config
from services.driver.loop import RunningJob, run_job
from services.driver.sinks import read_metrics

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Two SmolLM2 jobs of one shape (a rank and an engine): the second takes the gang the
first left (1.5 of the head's CPUs, beside the first test's own 0.5-CPU engine)."""


@pytest.mark.slow  # SmolLM2 imported, trained, evaluated twice
def test_one_rl_step_and_its_evaluations_on_smollm2(ray_cluster: None, smollm2_path: Path,
                                                    tmp_path: Path) -> None:
    from rollout.manager import RolloutManager
    from services.driver.evaluation import eval_metrics
    from services.runtime.gang import start_rollout_actors

    config = load_job_config(ROOT / "configs" / "smollm2-math.yaml", [
        f"rollout.model={smollm2_path}", "num_steps=1", "rollout.global_batch_size=4",
        "rollout.n_samples_per_prompt=2", "rollout.sampling.max_new_tokens=8",
        "rollout.engine.num_threads=1", "trainer.dp_size=1", "trainer.loss.entropy_coef=0.01",
        "eval.num_prompts=3", "eval.num_samples=2"])
    job = tmp_path / "job"
    lines: list[str] = []
    held = {}

    def after_last_step(_step: int, running: RunningJob) -> None:
        """What the job's engines hold once the final weights are synced (and evaluated):
        the manager's state and a rollout sampled from them."""
        manager, call = running.actors.manager, running.actors.rollout_call
        held["state"] = call(manager.state_dict.remote(), "state_dict")
        held["rollout"] = call(manager.generate_batch.remote(1), "generate_batch")

    history = run_job(config, job, log=lines.append, after_step=after_last_step)
    (first,) = history  # one step; the evaluation runs after it (and it is the last)
    # The trainer's log-probs (same weights, temperature 0.8) match the engine's, token for
    # token on the real tokenizer's ids: a wrong mask or shift would show here.
    assert first["mismatch/log_prob_abs_diff"] < 1e-3
    # A gradient through the whole model even when no group has reward spread (8 tokens
    # rarely reach an answer): the entropy bonus.
    assert first["tokens/valid"] > 0 and first["grad_norm"] > 0
    assert (first["eval/num_prompts"], first["eval/k"]) == (3.0, 2.0)
    assert 0 < first["eval/response_length"] <= 8 and "eval/accuracy/d1" in first
    assert sum(first[f"length_bias/token_mean/{b}"] for b in ("short", "middle", "long")
               ) == pytest.approx(1.0)
    assert any("eval accuracy" in line and "pass@2" in line for line in lines)
    assert [r["step"] for r in read_metrics(job / "metrics.jsonl")] == [0]
    # One evaluation, of the final trained weights (version 1), not of the start: a job of
    # one step leaves the start to the final weights' row.
    assert first["eval/weight_version"] == 1.0
    assert [r["step"] for r in read_metrics(job / "eval.jsonl")] == [1]

    # The final weights (the export of its checkpoint) hold one AdamW step at the logged
    # learning rate from the start: every weight moves by at most lr (|m̂ / √v̂| ≤ 1 on a
    # first step, no weight decay), the largest by about lr (float32 rounding aside).
    (update,) = read_metrics(job / "updates.jsonl")
    lr = update["metrics"]["lr"]
    start = load_file(str(smollm2_path / "model.safetensors"))
    trained = load_file(str(job / "final_model" / "model.safetensors"))
    assert trained.keys() <= start.keys()
    rounding = torch.finfo(torch.float32).eps
    for name, weights in trained.items():
        step = (weights - start[name]).abs()
        assert bool((step <= lr * (1 + 1e-5) + rounding * start[name].abs()).all()), name
    assert max(float((w - start[k]).abs().max()) for k, w in trained.items()) > 0.9 * lr

    # Those are the weights the engines evaluated: fresh engines given the checkpoint (and
    # the manager's state) sample the same rollout, log-probs included, and evaluate to
    # the logged metrics.
    actors = start_rollout_actors(config.rollout, str(smollm2_path))  # threads: the job's
    manager = RolloutManager(config.rollout, str(smollm2_path), engines=actors.engines,
                             owns_engines=True, teachers=actors.teachers,
                             reward_actors=actors.reward_actors)
    try:
        manager.update_weights_from_disk(str(job / "final_model"))
        manager.load_state_dict(held["state"])
        rollout = manager.generate_batch(1)
        assert torch.equal(rollout.input_ids, held["rollout"].input_ids)
        torch.testing.assert_close(rollout.rollout_log_probs,
                                   held["rollout"].rollout_log_probs, rtol=0, atol=0)
        evaluation = manager.evaluate(
            config.eval_dataset(), config.eval.num_prompts, config.eval.num_samples,
            config.eval.temperature or config.rollout.sampling.temperature, 1)
        direct = eval_metrics(evaluation.outcomes, config.eval)
        assert {k: first[k] for k in direct} == direct
    finally:
        manager.shutdown()


@pytest.mark.slow  # SmolLM2 imported and trained two steps on the example JSONL
def test_the_jsonl_example_config_gets_reward_in_its_first_steps(
        ray_cluster: None, smollm2_path: Path, tmp_path: Path) -> None:
    """configs/my-data.yaml, a user's own data as the README shows it, runs as written
    (from the repository root, where its paths point) and learns from its first steps: a
    group has reward spread, so the policy gradient is not zero. (Each of its 16 samples
    is right about one time in six: a step with none right is one in twenty, two in a
    row one in four hundred.)"""
    import os

    config = load_job_config(ROOT / "configs" / "my-data.yaml", [
        f"rollout.model={smollm2_path}", "num_steps=2", "eval.enabled=false",
        "trainer.dp_size=1", "rollout.engine.num_threads=1"])
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rows = run_job(config, tmp_path / "job", log=lambda *_: None)
    finally:
        os.chdir(cwd)
    learned = [row for row in rows if row["reward/std"] > 0]
    assert learned, [row["reward/mean"] for row in rows]
    assert all(row["rollout/prompts_truncated"] == 0 and row["rollout/prompts_dropped"] == 0
               for row in rows)
    assert learned[0]["grad_norm"] > 0
