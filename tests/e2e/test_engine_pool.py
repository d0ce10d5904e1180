"""One of two rollout engines killed with ``kill -9`` mid-job (its pid read from
events.jsonl's ``actor_started``): the job goes on without a restart, the gang replaces the
engine, every step keeps its N, and the rows are those of the same job left alone (the
lost engine's shard is re-run with its seed on the same weights: the same samples)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from services.driver.loop import RunningJob, run_job
from services.driver.sinks import read_metrics
from tests.services.driver.clean_run import clean_config, deterministic, final_weights

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Jobs of one shape one after another: each may take the gang the last one left."""

TWO_ENGINES = ["num_steps=3", "rollout.async_steps=0", "rollout.engine.num_engines=2",
               "trainer.dp_size=1", "max_restarts=1"]
"""The clean job's batches (4 prompts × 8, 2 optimizer steps of 16 × 2 epochs) on two
engines and one trainer rank, three steps: the engine dies after step 0, step 1 re-runs
its shard and replaces it, step 2 runs on the replacement."""


def events(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines()]


def same_rows(job: Path, clean: Path, file: str) -> None:
    """Every row of ``file`` holds the values of the clean job's, bit for bit, but the
    times and the engine counts (the clean job lost none)."""
    def kept(row: dict) -> dict:
        return {k: v for k, v in deterministic(row["metrics"]).items()
                if not k.startswith("rollout/engines_")}

    got, want = read_metrics(job / file), read_metrics(clean / file)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert kept(g) == kept(w), (file, g["step"])


def wait_gone(pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), f"pid {pid} still runs {timeout_s:g} s on"


@pytest.mark.slow  # two jobs of three steps
def test_a_killed_engine_is_replaced_and_the_job_trains_as_if_it_had_not_died(
        ray_cluster: None, tmp_path: Path) -> None:
    config = clean_config(*TWO_ENGINES)
    clean = tmp_path / "clean"
    run_job(config, clean, log=lambda *_: None)
    killed: list[int] = []

    def kill_engine_1(step: int, job: RunningJob) -> None:
        if step == 0:
            (pid,) = [e["pid"] for e in events(job.run_dir.path)
                      if e["kind"] == "actor_started" and e["role"] == "engine"
                      and e["rank"] == 1]
            os.kill(pid, signal.SIGKILL)
            wait_gone(pid)
            killed.append(pid)

    job = tmp_path / "job"
    rows = run_job(config, job, log=lambda *_: None, after_step=kill_engine_1)

    assert len(killed) == 1 and len(rows) == 3
    kinds = [e["kind"] for e in events(job)]
    assert "restart" not in kinds and "actor_failed" not in kinds
    (replaced,) = [e for e in events(job) if e["kind"] == "engine_replaced"]
    assert (replaced["rank"], replaced["old_pid"]) == (1, killed[0])
    assert replaced["new_pid"] != killed[0]
    started = [(e["role"], e["rank"], e["pid"]) for e in events(job)
               if e["kind"] == "actor_started"]
    assert ("engine", 1, replaced["new_pid"]) in started  # the replacement's own event
    assert {("engine", 0), ("engine", 1), ("manager", 0), ("policy", 0)} <= {
        (role, rank) for role, rank, _ in started}
    assert [r["rollout/engines_replaced"] for r in rows] == [0.0, 1.0, 0.0]
    assert [r["rollout/engines_lost"] for r in rows] == [0.0, 1.0, 0.0]
    batch = config.rollout.num_samples_per_rollout
    assert [r["rollout/generated_samples"] for r in rows] == [float(batch)] * 3
    assert [r["job/restarts"] for r in rows] == [0.0] * 3
    # the same samples, losses and weights as the job left alone
    same_rows(job, clean, "metrics.jsonl")
    same_rows(job, clean, "updates.jsonl")
    want = final_weights(clean)
    for name, tensor in final_weights(job).items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
