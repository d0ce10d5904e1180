"""The RL loop end to end on real Ray: learning, exact resume, failing fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.batch import RolloutBatch
from services.config.job import JobConfig, load_job_config
from services.driver.loop import run_job
from services.driver.metrics import SPREAD_METRICS, rollout_metrics
from services.train import main
from tests.services.driver.clean_run import (
    NUM_UPDATES,
    CleanRun,
    Interrupted,
    assert_same_training,
    clean_config,
    rows,
    stop_after,
)

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Jobs of one shape one after another: each may take the gang the last one left."""

ROOT = Path(__file__).resolve().parents[2]
# demo.yaml's warm-up (the one every test shares, tests/conftest.py's data folder caches
# it), a constant schedule.
SMALL = ["rollout.global_batch_size=32", "rollout.n_samples_per_prompt=8",
         "trainer.dp_size=2", "trainer.optimizer.lr=2.0e-3",
         "trainer.optimizer.schedule=constant"]


# A short run that learns (and is evaluated): tests/services/driver/test_loop.py.
# Exact resume of an in-job restart: tests/e2e/test_recovery.py; of a newest
# checkpoint that cannot be read: tests/e2e/test_resume_fallback.py.


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


def test_a_job_too_large_for_the_cluster_it_joins_is_refused_before_the_driver_imports(
        ray_cluster: None, tmp_path: Path) -> None:
    """``python -m services.train`` on a cluster it joins (RAY_ADDRESS: ``ray job submit``,
    the controller) that can never hold the job: exit 1 and run_job's line and events,
    with neither the driver nor torch imported (their imports are what made the refusal
    slow)."""
    import ray

    code = ("import sys\n"
            "from services.train import main\n"
            "done = main(sys.argv[1:])\n"
            "print(done, sorted({'torch', 'services.driver.loop'} & set(sys.modules)))\n")
    out = tmp_path / "job"
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "configs" / "demo.yaml"), "--output-dir",
         str(out), "--set", "trainer.num_cpus_per_rank=3"], cwd=ROOT, capture_output=True,
        text=True, timeout=120,
        env={**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address})
    assert done.stdout.strip().splitlines()[-1] == "1 []", done.stdout + done.stderr[-3000:]
    why = ("the job can never fit this Ray cluster: it needs 6.5 CPU, the cluster has 4 CPU "
           "in all; lower trainer.num_cpus_per_rank / trainer.dp_size")
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: job demo: {why}")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events] == ["placement_failed", "failed"]
    assert events[0]["message"].startswith(why) and events[1]["exit_code"] == 1
    assert events[1]["message"].startswith(f"job demo: {why}")


def test_several_optimizer_steps_per_rollout_in_order_and_clipping_acts(
        clean_run: CleanRun) -> None:
    """The clean run (tests/services/driver/clean_run.py): 32 samples per rollout in
    mini-batches of 16 for 2 epochs, 2 rollouts asked for ahead."""
    history = clean_run.history
    assert [m["updates"] for m in history] == [float(NUM_UPDATES)] * 4
    # Rollout s is asked for at step s - 2 (s ≥ 2), behind the load of weights s - 2.
    assert [m["rollout/staleness"] for m in history] == [0.0, 1.0, 2.0, 2.0]
    updates = rows(clean_run.path / "updates.jsonl")
    assert [r["step"] for r in updates] == list(range(4 * NUM_UPDATES))
    by_rollout = [[r["metrics"] for r in updates if r["metrics"]["rollout"] == k]
                  for k in range(4)]
    for rollout in by_rollout:
        assert [u["update"] for u in rollout] == list(range(NUM_UPDATES))
        assert [u["epoch"] for u in rollout] == [0.0, 0.0, 1.0, 1.0]
        # The first update is taken at the policy that computed the old log-probs: ρ = 1.
        assert rollout[0]["ratio/mean_abs_dev"] < 1e-6
        assert rollout[0]["clip_fraction"] == 0.0
    assert max(u["clip_fraction"] for r in by_rollout for u in r[1:]) > 0  # clipping acts
    assert max(m["clip_fraction/max"] for m in history) > 0


@pytest.mark.slow  # two starts of the job's actors
def test_a_resume_past_the_last_checkpoint_repeats_the_steps_after_it_exactly(
        clean_run: CleanRun, tmp_path: Path) -> None:
    """Checkpoints every 2 steps; stopped after step 2, whose row and optimizer steps are
    written but not checkpointed: the resume drops them, starts from step 1's checkpoint
    (which holds rollouts 2 and 3, generated from weight versions 0 and 1) and the job
    folder ends as the clean run's."""
    config = clean_config("checkpoint_every=2")
    job = tmp_path / "job"
    with pytest.raises(Interrupted):
        run_job(config, job, log=lambda *_: None, after_step=stop_after(2))
    assert [r["step"] for r in rows(job / "metrics.jsonl")] == [0, 1, 2]
    assert len(rows(job / "updates.jsonl")) == 3 * NUM_UPDATES
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["latest",
                                                                       "step_00000001"]
    resumed = run_job(config, job, log=lambda *_: None)
    assert len(resumed) == 2  # steps 2 and 3
    # The saved rollouts, not fresh ones from the restored weights (version 2: staleness 0).
    assert [m["rollout/staleness"] for m in resumed] == [2.0, 2.0]
    assert_same_training(job, clean_run)


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


SYNCHRONOUS = [*SMALL, "trainer.dp_size=1", "trainer.loss.tis_cap=2.0", "num_steps=2"]
"""A synchronous one-rank job of 2 steps whose engine actor loads each version: the
reference of the pipelined job and of the colocated one below (one run for both)."""


def drive(config: JobConfig, folder: Path, lookahead: int | None) -> list[dict[str, float]]:
    """Each row of ``config``'s job as :func:`rollout_step` returns it, every rollout with
    ``lookahead`` (None: the config's rollout.async_steps)."""
    from services.driver.job import job_model_path, with_threads
    from services.driver.loop import RunningJob, rollout_step
    from services.driver.run_dir import RunDir

    model_path = job_model_path(config)
    job = RunningJob.start(with_threads(config, model_path), RunDir(folder).create(),
                           model_path, log=lambda *_: None)
    healthy = False
    try:
        rows = [rollout_step(job, step, lookahead) for step in range(config.num_steps)]
        healthy = True
        return rows
    finally:
        job.close(healthy)  # healthy: the next job may take its gang (warm_gang_pool)


@pytest.fixture(scope="module")
def synchronous(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
                ) -> list[dict[str, float]]:
    """SYNCHRONOUS's rows, run once for the two tests that compare with it."""
    return drive(load_job_config(ROOT / "configs" / "demo.yaml", SYNCHRONOUS),
                 tmp_path_factory.mktemp("sync"), None)


@pytest.mark.slow  # one job, and the synchronous one
def test_async_pipeline_made_to_wait_for_the_newest_weights_equals_synchronous(
        synchronous: list[dict[str, float]], tmp_path: Path) -> None:
    """The pipeline's bookkeeping (rollouts asked for ahead, their seeds, group indices,
    cursor, weight versions) is exact: an async job whose rollouts each wait for the
    weights of their own step (lookahead 0) computes what the synchronous job does."""
    pipelined = load_job_config(ROOT / "configs" / "demo.yaml",
                                [*SYNCHRONOUS, "rollout.async_steps=1"])
    got = drive(pipelined, tmp_path / "waiting", 0)
    assert [m["rollout/staleness"] for m in got] == [0.0, 0.0]
    for step, (g, w) in enumerate(zip(got, synchronous, strict=True)):
        assert g.keys() == w.keys()
        differing = {k for k in w if not k.startswith(("perf/", "rollout/gen_"))
                     and g[k] != w[k]}
        assert not differing, (step, {k: (g[k], w[k]) for k in differing})


@pytest.mark.slow  # one colocated job, stopped and resumed
def test_colocated_fast_path_trains_what_engine_actors_do_and_resumes_exactly(
        clean_run: CleanRun, tmp_path: Path) -> None:
    """colocate: true with a torch engine generates inside the trainer ranks: at DP 2 with
    2 rollouts asked for ahead, each rank gathers a copy of every version it is sent,
    served in the manager's order. Stopped after step 1 and resumed, the job trains bit
    for bit what the clean run (an engine actor fed through the object store) did."""
    config = clean_config("colocate=true")
    assert config.weight_transport() == "in_process"
    job = tmp_path / "job"
    with pytest.raises(Interrupted):
        run_job(config, job, log=lambda *_: None, after_step=stop_after(1))
    run_job(config, job, log=lambda *_: None)
    assert_same_training(job, clean_run)
    assert all(r["metrics"]["perf/sync_bytes"] > 0 for r in rows(job / "metrics.jsonl"))


@pytest.mark.slow  # one job, and the synchronous one
def test_colocated_one_synchronous_rank_generates_from_its_own_weights(
        synchronous: list[dict[str, float]], tmp_path: Path) -> None:
    """One rank, rollout.async_steps 0, the engine in the trainer's dtype: the engine's
    tensors are the rank's parameters, nothing is ever copied, and the job computes what
    the synchronous job computes with an engine actor loading each version."""
    config = load_job_config(ROOT / "configs" / "demo.yaml", [*SYNCHRONOUS, "colocate=true"])
    assert config.weight_transport() == "in_process"
    aliased = run_job(config, tmp_path / "aliased", log=lambda *_: None)
    assert [m["perf/sync_bytes"] for m in aliased] == [0.0, 0.0]
    assert all(m["perf/sync_bytes"] > 0 for m in synchronous)
    for got, want in zip(aliased, synchronous, strict=True):
        differing = {k for k in want if not k.startswith(("perf/", "rollout/gen_"))
                     and got[k] != want[k]}
        assert not differing, {k: (got[k], want[k]) for k in differing}
