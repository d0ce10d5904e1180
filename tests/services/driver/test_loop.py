"""The driver loop on real Ray with the tiny model: a rank dying during the weight export
restarts the job (it does not fail it) and the job ends as the clean run, a short run
learns and its final trained weights are evaluated in the last row (and the W&B run
holds every row), an
optimizer step with no valid token is skipped, not taken, and a start with no checkpoint
drops the rows an earlier attempt wrote."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import torch

from rollout.batch import RolloutBatch
from services.config.job import load_job_config
from services.driver.job import job_model_path
from services.driver.loop import RunningJob, run_job, train_optimizer_steps
from services.driver.metrics import optimizer_steps_summary
from services.driver.sinks import JsonlSink, read_metrics
from services.runtime.gang import actor_starts, warm_gangs
from tests.services.controller.fakes import DEMO_OVERRIDES
from tests.services.driver.clean_run import CleanRun, assert_same_training, clean_config
from tests.services.driver.test_wandb_sink import finished_run_records, history_of
from tests.services.test_train import ROOT, SMALL
from trainer.checkpoint_check import unreadable
from trainer.group import TrainerGroup


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two starts of the job's actors
@pytest.mark.usefixtures("warm_gang_pool")
def test_a_rank_dying_during_the_weight_export_restarts_the_job(clean_run: CleanRun,
                                                                tmp_path: Path) -> None:
    killed: list[int] = []

    def kill_rank_1_as_step_1_exports(step: int, job: RunningJob) -> None:
        if step != 0 or killed:
            return
        send = job.weights.transport.send_weights

        def dying_send(version: int):  # the bucket export starts with rank 1 gone
            ray.kill(job.actors.trainer.workers[1])
            killed.append(step)
            return send(version)

        job.weights.transport.send_weights = dying_send

    rows = run_job(clean_config(), tmp_path / "job", log=lambda *_: None,
                   after_step=kill_rank_1_as_step_1_exports)
    assert killed == [0]
    assert [r["job/restarts"] for r in rows] == [0.0, 1.0, 1.0, 1.0]  # step 1 ran again
    failed = [e["message"] for e in events(tmp_path / "job") if e["kind"] == "actor_failed"]
    assert len(failed) == 1 and "trainer rank 1 died during send_weights" in failed[0]
    kinds = [e["kind"] for e in events(tmp_path / "job")]
    assert kinds.count("placement") == 2 and kinds.count("restart") == 1
    assert_same_training(tmp_path / "job", clean_run)  # rows before the failure kept


# With rollout.async_steps: test_evaluation.py's evaluated clean run.
@pytest.mark.slow  # a one-step job, then the clean job on its processes
def test_a_job_on_the_gang_another_job_left_trains_what_the_clean_run_does(
        clean_run: CleanRun, tmp_path: Path) -> None:
    """warm_gangs: after a job of another seed, learning rate, temperature and length,
    the clean job runs on the same processes (the gang reused: no actor started, the
    same pids) and trains bit for bit what the clean run did on a fresh gang."""
    other = clean_config("num_steps=1", "rollout.seed=11", "trainer.optimizer.lr=5e-3",
                         "rollout.sampling.temperature=0.7")
    with warm_gangs():
        run_job(other, tmp_path / "other", log=lambda *_: None)
        started = sum(actor_starts.values())
        run_job(clean_config(), tmp_path / "job", log=lambda *_: None)
        assert sum(actor_starts.values()) == started

    def pids(job: Path) -> dict[str, int]:
        return {f"{e['role']}{e['rank']}": e["pid"] for e in events(job)
                if e["kind"] == "actor_started"}

    assert pids(tmp_path / "job") == pids(tmp_path / "other")
    assert len(pids(tmp_path / "job")) == 4  # 2 ranks, an engine, the manager
    assert_same_training(tmp_path / "job", clean_run)


@pytest.mark.slow  # 40 rollout steps of 128 samples, evaluated three times
@pytest.mark.usefixtures("warm_gang_pool")
def test_a_short_run_improves_reward_and_its_final_weights_are_evaluated_in_the_last_row(
        ray_cluster: None, wandb_home: Path, tmp_path: Path) -> None:
    """One job shows that RL learns (the reward of the last 8 rollout steps beats the
    first 8), logs every mode's loss and length bias, checkpoints its last step, exports
    its final weights, evaluates the start, every 20 steps and the final trained weights
    (in the last row), and that its W&B run holds what metrics.jsonl holds."""
    config = load_job_config(ROOT / "configs" / "demo.yaml", [
        *SMALL, "num_steps=40", "rollout.global_batch_size=128",
        "eval.enabled=true", "eval.every_steps=20", "eval.num_prompts=8", "eval.num_samples=2",
        "eval.dataset={type: synthetic, task: copy, difficulty: 1, seed: 7}",
        "logging.wandb={project: tally-tests, mode: offline}"])
    job = tmp_path / "job"
    history = run_job(config, job, log=lambda *_: None)
    rewards = [m["reward/mean"] for m in history]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.05, rewards
    logged = read_metrics(job / "metrics.jsonl")
    assert [r["step"] for r in logged] == list(range(40))
    for mode in ("sample_mean", "token_mean", "prompt_mean", "constant"):
        assert f"pg_loss/{mode}" in logged[-1]["metrics"]
        assert sum(logged[-1]["metrics"][f"length_bias/{mode}/{bucket}"]
                   for bucket in ("short", "middle", "long")) == pytest.approx(1.0)
    assert unreadable(job / "checkpoints" / "step_00000039") is None
    assert (job / "final_model" / "config.json").exists()
    # The job's W&B run (offline) holds what metrics.jsonl holds, row by row.
    [log] = job.glob("wandb/offline-run-*/run-*.wandb")
    assert history_of(finished_run_records(log)) == {
        row["step"]: {k: v for k, v in row["metrics"].items() if v is not None}
        for row in logged}
    # Version 0 (the start) in row 0, version 20 in row 20, and the weights after all 40
    # steps, as the manager says it held them, in the last row.
    assert history[-1]["eval/weight_version"] == 40.0
    evaluated = read_metrics(job / "eval.jsonl")
    assert [r["step"] for r in evaluated] == [0, 20, 40]
    assert [r["metrics"]["eval/weight_version"] for r in evaluated] == [0.0, 20.0, 40.0]
    assert 0.0 <= history[-1]["eval/accuracy"] <= 1.0


@pytest.mark.slow
def test_a_mini_batch_with_no_valid_token_is_skipped_not_stepped(ray_cluster: None,
                                                                 tmp_path: Path) -> None:
    config = load_job_config(ROOT / "configs" / "demo.yaml", [
        *DEMO_OVERRIDES, "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.global_batch_size=2", "trainer.optimizer.lr=1e-2"])
    # Group 0 has valid tokens; every token of group 1 is masked out (say, a tool's).
    batch = RolloutBatch.from_samples(
        prompt_ids=[[3, 4]] * 4, response_ids=[[5, 6], [7], [5, 6], [7]],
        response_log_probs=[[-1.0, -1.0], [-1.0]] * 2, rewards=[1.0, 0.0, 1.0, 0.0],
        advantages=[1.0, -1.0, 1.0, -1.0], group_index=[0, 0, 1, 1], samples_per_prompt=2,
        response_masks=[[1, 1], [1], [0, 0], [0]])
    model_path = job_model_path(config)
    trainers = [TrainerGroup(config.trainer, config.objective_config(), model_path, 4)
                for _ in range(2)]
    try:
        job = SimpleNamespace(config=config, actors=SimpleNamespace(trainer=trainers[0],
                                                                    critic=None),
                              updates=JsonlSink(tmp_path, "updates.jsonl"))
        per_update = train_optimizer_steps(job, 0, batch, None)
        job.updates.close()
        assert sorted(u.get("skipped", 0.0) for u in per_update) == [0.0, 1.0]
        summary = optimizer_steps_summary(per_update)
        assert summary["updates"] == 1.0 and summary["updates/skipped"] == 1.0
        rows = read_metrics(tmp_path / "updates.jsonl")
        assert [r["step"] for r in rows] == [0, 1]
        assert [("grad_norm" in r["metrics"]) for r in rows] == [
            not u.get("skipped") for u in per_update]
        # The same weights as one optimizer step on group 0 alone: nothing moved for the
        # empty mini-batch (AdamW's momentum would move them on a zero gradient).
        alone = batch.select([0, 1])
        alone = alone.with_old_log_probs(trainers[1].log_probs(batch)[[0, 1]])
        trainers[1].train(alone)
        skipped, reference = (ray.get(t.async_export_weights()) for t in trainers)
        for name, tensor in reference.items():
            torch.testing.assert_close(skipped[name], tensor, rtol=0, atol=0)
    finally:
        for trainer in trainers:
            trainer.shutdown()


def test_a_start_with_no_checkpoint_drops_the_rows_an_earlier_attempt_wrote(
        tmp_path: Path) -> None:
    """A job that failed (or was stopped) before its first checkpoint runs again from step
    0: the rows it wrote go, so each step keeps one row. (After a checkpoint: the resume
    and restart tests against the clean run.)"""
    from services.driver.loop import restore
    from services.driver.run_dir import RunDir

    run_dir = RunDir(tmp_path / "job").create()
    for name, steps in (("metrics.jsonl", 2), ("updates.jsonl", 4), ("eval.jsonl", 1)):
        sink = JsonlSink(run_dir.path, name)
        for step in range(steps):
            sink.write(step, {"loss": 1.0})
        sink.close()
    job = SimpleNamespace(run_dir=run_dir,
                          config=SimpleNamespace(num_updates_per_rollout=2))
    assert restore(job, None, log=lambda *_: None) == 0
    for name in ("metrics.jsonl", "updates.jsonl", "eval.jsonl"):
        assert read_metrics(run_dir.path / name) == [], name
