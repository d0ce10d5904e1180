"""An actor lost mid-job — a trainer rank, a rollout engine or the rollout manager killed,
a trainer rank hung past its call timeout — restarts the job's actors, the job resumes
from its last checkpoint, and its folder ends as the clean run's
(tests/services/driver/clean_run.py); with no restart left it fails, naming what died."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from services.config.job import load_job_config
from services.driver.loop import JobFailed, RunningJob, run_job
from tests.services.driver.clean_run import (
    CleanRun,
    assert_same_training,
    clean_config,
    wait_until_dead,
)
from tests.services.test_train import ROOT, SMALL

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Jobs of one shape one after another: each may take the gang the last one left."""


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "events.jsonl").read_text().splitlines()]


def kill_engine(job: RunningJob) -> Callable[[], ray.ObjectRef]:
    # The manager owns its engines; Ray's __ray_call__ reads its handle list.
    (engine,) = ray.get(job.actors.manager.__ray_call__.remote(lambda manager: manager.engines))
    ray.kill(engine)
    return engine.ping.remote


def kill_manager(job: RunningJob) -> Callable[[], ray.ObjectRef]:
    ray.kill(job.actors.manager)
    return job.actors.manager.engine_nodes.remote


# Killed after step 1 (checkpointed), with rollouts 2 and 3 generated and weights 2 loaded.
# Where the loss shows decides which checkpoint the job restarts from:
#   engine: the manager's load of weights 3 fails (rollout 3 is already generated), seen
#     at step 3 → from step 2;
#   manager: step 2's checkpoint asks it for its state, after step 2's row is written →
#     from step 1, and step 2's row (and its optimizer steps) is written again, not twice.
# A trainer rank killed: tests/services/driver/test_loop.py (during the weight export).
@pytest.mark.parametrize(("kill", "restarts"), [
    (kill_engine, [0.0, 0.0, 0.0, 1.0]),
    (kill_manager, [0.0, 0.0, 1.0, 1.0]),
], ids=["engine", "manager"])
@pytest.mark.slow  # two starts of the job's actors each
def test_a_killed_actor_restarts_the_job_which_ends_as_the_clean_run(
        clean_run: CleanRun, tmp_path: Path,
        kill: Callable[[RunningJob], Callable[[], ray.ObjectRef]],
        restarts: list[float]) -> None:
    killed: list[int] = []

    def after_step(step: int, job: RunningJob) -> None:
        if step == 1 and not killed:
            wait_until_dead(kill(job))
            killed.append(step)

    rows = run_job(clean_config(), tmp_path / "job", log=lambda *_: None,
                   after_step=after_step)
    assert killed == [1]
    assert [m["job/restarts"] for m in rows] == restarts
    assert_same_training(tmp_path / "job", clean_run)
    kinds = [e["kind"] for e in events(tmp_path / "job")]
    assert kinds.count("placement") == 2
    assert kinds.count("actor_failed") == 1 and kinds.count("restart") == 1


@pytest.mark.slow  # two starts of the job's actors
def test_a_rank_hung_past_the_call_timeout_restarts_the_job(clean_run: CleanRun,
                                                            tmp_path: Path) -> None:
    """Rank 1's process is stopped (SIGSTOP: alive, never answering, like a rank stuck in
    a collective); this start's trainer.call_timeout_s is lowered to 3 s so the test does
    not wait the default half hour. The next trainer call times out, the job restarts with
    new ranks (the stopped one is killed) and the configured timeout, and ends as the
    clean run."""
    stopped: list[int] = []

    def after_step(step: int, job: RunningJob) -> None:
        if step == 1 and not stopped:
            trainer = job.actors.trainer
            pid = ray.get(trainer.workers[1].__ray_call__.remote(lambda _: os.getpid()))
            trainer.config = trainer.config.model_copy(update={"call_timeout_s": 3.0})
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

    try:
        rows = run_job(clean_config(), tmp_path / "job", log=lambda *_: None,
                       after_step=after_step)
        assert [m["job/restarts"] for m in rows] == [0.0, 0.0, 1.0, 1.0]
        assert_same_training(tmp_path / "job", clean_run)
        failed = [e["message"] for e in events(tmp_path / "job") if e["kind"] == "actor_failed"]
        assert len(failed) == 1
        assert re.fullmatch(r"trainer: ranks \[(0, )?1\] did not finish \w+ within 3 s",
                            failed[0]), failed
        assert not Path(f"/proc/{stopped[0]}").exists()  # the job's restart killed it
    finally:
        for pid in stopped:  # never leave a stopped process behind if the job did not
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def kill_rank_after(step_to_kill: int, rank: int = 1):
    def hook(step: int, job: RunningJob) -> None:
        if step == step_to_kill:
            ray.kill(job.actors.trainer.workers[rank])

    return hook


@pytest.mark.slow
def test_no_restarts_left_fails_naming_the_actor(ray_cluster: None, tmp_path: Path) -> None:
    config = load_job_config(ROOT / "configs" / "demo.yaml",
                             [*SMALL, "num_steps=3", "max_restarts=0"])
    # the rank's next call after step 0: the logged samples' token_stats (logging.
    # sample_tokens, on by default) or, without it, the step's train_step
    with pytest.raises(JobFailed, match=r"trainer rank 1 died during (token_stats|train_step)"):
        run_job(config, tmp_path / "job", log=lambda *_: None, after_step=kill_rank_after(0))
    rows = (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [0]  # what was recorded stays
    assert events(tmp_path / "job")[-1]["kind"] == "actor_failed"


@pytest.mark.slow
def test_a_rollout_call_past_its_timeout_fails_the_job_naming_the_field(
        ray_cluster: None, tmp_path: Path) -> None:
    # One trainer rank (SMALL has 2): the rollout call that times out is the manager's,
    # which no rank takes part in; a second rank would only be one more actor to start.
    config = load_job_config(ROOT / "configs" / "demo.yaml",
                             [*SMALL, "trainer.dp_size=1", "num_steps=2", "max_restarts=0",
                              "rollout.call_timeout_s=0.000001"])
    with pytest.raises(JobFailed, match=r"rollout \w+ took longer than "
                                        r"rollout.call_timeout_s=1e-06 s"):
        run_job(config, tmp_path / "job", log=lambda *_: None)
    assert events(tmp_path / "job")[-1]["kind"] == "actor_failed"
