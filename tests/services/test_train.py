"""The RL loop end to end on real Ray: learning, exact resume, failing fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout.batch import RolloutBatch
from services.config import load_job_config
from services.driver.loop import run_job
from services.driver.metrics import SPREAD_METRICS, rollout_metrics
from services.train import main

ROOT = Path(__file__).resolve().parents[2]
# A constant schedule: the cosine one depends on num_steps, which the resume test varies.
SMALL = ["warmup.num_steps=100", "rollout.global_batch_size=32", "rollout.n_samples_per_prompt=8",
         "trainer.dp_size=2", "trainer.optimizer.lr=2.0e-3",
         "trainer.optimizer.schedule=constant"]


@pytest.fixture(autouse=True)
def data_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One data folder per session, so the tiny model and warm start are built once."""
    path = tmp_path_factory.getbasetemp() / "tally-data"
    monkeypatch.setenv("TALLY_DATA_DIR", str(path))
    return path


def test_short_run_improves_reward(ray_cluster: None, tmp_path: Path) -> None:
    config = load_job_config(ROOT / "configs" / "demo.yaml",
                             [*SMALL, "num_steps=40", "rollout.global_batch_size=128"])
    history = run_job(config, tmp_path / "job", log=lambda *_: None)
    rewards = [m["reward/mean"] for m in history]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.05, rewards
    rows = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == list(range(40))
    for mode in ("sample_mean", "token_mean", "prompt_mean", "constant"):
        assert f"pg_loss/{mode}" in rows[-1]["metrics"]
        assert sum(rows[-1]["metrics"][f"length_bias/{mode}/{bucket}"]
                   for bucket in ("short", "middle", "long")) == pytest.approx(1.0)
    assert (tmp_path / "job" / "checkpoints" / "step_00000039" / "model" / "config.json").exists()


class Interrupted(Exception):
    """Stands for a job stopped from outside between two steps."""


def interrupted_then_resumed(config, output_dir: Path) -> list[dict[str, float]]:
    """Run ``config`` until its second step is done, stop it, run it again (same config,
    so the same schedule): what the resumed run did."""

    def stop_after_step_2(step: int, _job: object) -> None:
        if step == 1:
            raise Interrupted

    with pytest.raises(Interrupted):
        run_job(config, output_dir, log=lambda *_: None, after_step=stop_after_step_2)
    return run_job(config, output_dir, log=lambda *_: None)


# Exact resume of a fresh run from its job folder (metrics truncated after the checkpoint)
# is test_several_updates_per_rollout_clip_and_resume_exactly's; of an in-job restart with
# one update per rollout, tests/services/test_recovery.py's killed-rank test.


def test_half_written_checkpoint_is_never_loaded(ray_cluster: None, tmp_path: Path) -> None:
    from trainer.checkpoint import latest_checkpoint, staging_path

    staging_path(tmp_path, 7).mkdir(parents=True)  # a crash mid-write leaves this behind
    assert latest_checkpoint(tmp_path) is None


def test_bad_config_fails_before_any_actor_starts(tmp_path: Path, capsys, monkeypatch) -> None:
    def no_ray(*_args: object) -> bool:
        raise AssertionError("Ray must not start for a rejected config")

    monkeypatch.setattr("services.driver.loop.ensure_ray", no_ray)
    bad = tmp_path / "bad.yaml"
    bad.write_text("aggregation:\n  mode: constant\ntrainer:\n  dp_size: 0\n")
    assert main([str(bad), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "aggregation: divisor: mode=constant needs a divisor" in err
    assert "trainer.dp_size: Input should be greater than or equal to 1" in err
    assert not (tmp_path / "out").exists()


# The README's command (64 prompts × 8 samples per rollout, 4 steps of 128, 2 epochs) at a
# quarter of its size: 16 prompts × 8 = 128 samples, 4 steps of 32, 2 epochs.
# The resume also crosses the async pipeline: the checkpoint of step 2 holds the rollout
# of step 3, generated from step 1's weights, and the resumed run must train on it.
SEVERAL_UPDATES = ["rollout.rollout_batch_size=16", "rollout.global_batch_size=32",
                   "trainer.ppo_epochs=2", "checkpoint_every=1", "rollout.async_steps=2"]


def test_several_updates_per_rollout_clip_and_resume_exactly(ray_cluster: None,
                                                             tmp_path: Path) -> None:
    from services.driver.run_dir import UPDATES_FILE
    from services.driver.sinks import read_metrics

    def job(num_steps: int):
        return load_job_config(ROOT / "configs" / "demo.yaml",
                               [*SEVERAL_UPDATES, f"num_steps={num_steps}"])

    straight = run_job(job(3), tmp_path / "straight", log=lambda *_: None)
    assert [m["updates"] for m in straight] == [8.0, 8.0, 8.0]
    # Rollout s was asked for before step 0 trained (s ≤ 2): weights of step 0.
    assert [m["rollout/staleness"] for m in straight] == [0.0, 1.0, 2.0]
    updates = read_metrics(tmp_path / "straight" / UPDATES_FILE)
    assert [r["step"] for r in updates] == list(range(24))  # 3 rollouts × 8 steps
    by_rollout = [[r["metrics"] for r in updates if r["metrics"]["rollout"] == k]
                  for k in range(3)]
    for rollout in by_rollout:
        assert [u["update"] for u in rollout] == list(range(8))
        assert [u["epoch"] for u in rollout] == [0.0] * 4 + [1.0] * 4
        # The first update is taken at the policy that computed the old log-probs: ρ = 1.
        assert rollout[0]["ratio/mean_abs_dev"] < 1e-6
        assert rollout[0]["clip_fraction"] == 0.0
    assert max(u["clip_fraction"] for r in by_rollout for u in r[1:]) > 0  # clipping acts
    assert straight[0]["clip_fraction/max"] > 0

    resumed = interrupted_then_resumed(job(3), tmp_path / "resumed")
    assert len(resumed) == 1
    assert resumed[0]["rollout/staleness"] == 2.0  # the saved rollout, not a fresh one
    for key in ("reward/mean", "pg_loss", "clip_fraction", "grad_norm", "kl"):
        assert resumed[0][key] == pytest.approx(straight[2][key], rel=1e-6, abs=1e-9), key
    again = read_metrics(tmp_path / "resumed" / UPDATES_FILE)
    assert [r["step"] for r in again] == list(range(24))
    for got, want in zip(again[16:], updates[16:], strict=True):
        assert got["metrics"]["pg_loss"] == pytest.approx(want["metrics"]["pg_loss"],
                                                          rel=1e-6, abs=1e-9)
    final = "checkpoints/step_00000002/model/model.safetensors"
    straight_weights = load_file(str(tmp_path / "straight" / final))
    for name, tensor in load_file(str(tmp_path / "resumed" / final)).items():
        torch.testing.assert_close(tensor, straight_weights[name], rtol=1e-6, atol=1e-7)


def test_step_metrics_log_the_length_bias_of_every_mode_from_the_loss_mask() -> None:
    # Groups A (1, 2, 9 valid tokens) and B (3, 3, 4), as in tests/trainer/test_length_bias.
    # The first response has 10 tokens of which 9 are masked (say, a tool's output): by
    # response length it would be long, by valid tokens M_i = 1 it is short.
    valid = [1, 2, 9, 3, 3, 4]
    responses = [[5] * 10, *([5] * m for m in valid[1:])]
    masks = [[1] + [0] * 9, *([1] * m for m in valid[1:])]
    batch = RolloutBatch.from_samples(
        prompt_ids=[[1, 2]] * 6, response_ids=responses,
        response_log_probs=[[-1.0] * len(r) for r in responses], rewards=[0.0] * 6,
        advantages=[0.0] * 6, group_index=[0, 0, 0, 1, 1, 1], samples_per_prompt=3,
        response_masks=masks)
    update = {name: 0.0 for name in SPREAD_METRICS} | {"perf/compute_s": 1.0, "lr": 1e-3}
    metrics = rollout_metrics(batch, [update], {"rollout": 1.0}, constant_divisor=8.0)
    expected = {"sample_mean": (1 / 3, 1 / 3, 1 / 3),
                "token_mean": (3 / 22, 6 / 22, 13 / 22),
                "prompt_mean": (3 / 24, 6 / 20, 9 / 24 + 4 / 20),
                "constant": (3 / 22, 6 / 22, 13 / 22)}
    for mode, shares in expected.items():
        logged = [metrics[f"length_bias/{mode}/{b}"] for b in ("short", "middle", "long")]
        assert logged == pytest.approx(shares, rel=1e-12), mode
    assert len([k for k in metrics if k.startswith("length_bias/")]) == 12


def test_async_pipeline_made_to_wait_for_the_newest_weights_equals_synchronous(
        ray_cluster: None, tmp_path: Path) -> None:
    """The pipeline's bookkeeping (rollouts asked for ahead, their seeds, group indices,
    cursor, weight versions) is exact: an async job whose rollouts each wait for the
    weights of their own step (lookahead 0) computes what the synchronous job does."""
    from services.driver.job import job_model_path, with_threads
    from services.driver.loop import RunningJob, rollout_step
    from services.driver.run_dir import RunDir

    base = [*SMALL, "trainer.dp_size=1", "trainer.loss.tis_cap=2.0", "num_steps=2"]
    synchronous = load_job_config(ROOT / "configs" / "demo.yaml", base)
    pipelined = load_job_config(ROOT / "configs" / "demo.yaml",
                                [*base, "rollout.async_steps=1"])

    def drive(config, name: str, lookahead: int | None) -> list[dict[str, float]]:
        model_path = job_model_path(config)
        job = RunningJob.start(with_threads(config, model_path), RunDir(tmp_path / name).create(),
                        model_path, log=lambda *_: None)
        try:
            return [rollout_step(job, step, lookahead) for step in range(config.num_steps)]
        finally:
            job.close()

    want = drive(synchronous, "sync", None)
    got = drive(pipelined, "waiting", 0)
    assert [m["rollout/staleness"] for m in got] == [0.0, 0.0]
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        differing = {k for k in w if not k.startswith(("perf/", "rollout/gen_"))
                     and g[k] != w[k]}
        assert not differing, (step, {k: (g[k], w[k]) for k in differing})
