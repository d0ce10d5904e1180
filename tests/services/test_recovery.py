"""A trainer rank killed mid-job: the driver notices, restarts the actors, resumes from the
last checkpoint, and the steps after recovery equal those of a clean run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from services.config import load_job_config
from services.driver.loop import JobFailed, RunningJob, run_job
from tests.services.test_train import ROOT, SMALL


@pytest.fixture(autouse=True)
def data_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TALLY_DATA_DIR", str(tmp_path_factory.getbasetemp() / "tally-data"))


def kill_rank_after(step_to_kill: int, rank: int = 1):
    killed: list[int] = []

    def hook(step: int, job: RunningJob) -> None:
        if step == step_to_kill and not killed:
            ray.kill(job.actors.trainer.workers[rank])
            killed.append(step)

    return hook


def events(path: Path) -> list[str]:
    return [json.loads(line)["kind"] for line in (path / "events.jsonl").read_text().splitlines()]


def test_killed_rank_restarts_and_resumes_exactly(ray_cluster: None, tmp_path: Path) -> None:
    config = load_job_config(ROOT / "configs" / "demo.yaml",
                             [*SMALL, "num_steps=4", "checkpoint_every=1", "max_restarts=1"])
    clean = run_job(config, tmp_path / "clean", log=lambda *_: None)
    recovered = run_job(config, tmp_path / "recovered", log=lambda *_: None,
                        after_step=kill_rank_after(1))
    assert [m["job/restarts"] for m in recovered] == [0.0, 0.0, 1.0, 1.0]
    for step in (2, 3):
        for key in ("reward/mean", "pg_loss/token_mean", "grad_norm", "entropy"):
            assert recovered[step][key] == pytest.approx(clean[step][key], rel=1e-6), key
    final = "checkpoints/step_00000003/model/model.safetensors"
    clean_weights = load_file(str(tmp_path / "clean" / final))
    for name, tensor in load_file(str(tmp_path / "recovered" / final)).items():
        torch.testing.assert_close(tensor, clean_weights[name], rtol=1e-6, atol=1e-7)
    kinds = events(tmp_path / "recovered")
    assert kinds.count("placement") == 2 and "actor_failed" in kinds and "restart" in kinds
    steps = [json.loads(r)["step"] for r in
             (tmp_path / "recovered" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]  # rows recorded before the failure were kept


def test_no_restarts_left_fails_naming_the_actor(ray_cluster: None, tmp_path: Path) -> None:
    config = load_job_config(ROOT / "configs" / "demo.yaml",
                             [*SMALL, "num_steps=3", "max_restarts=0"])
    with pytest.raises(JobFailed, match=r"trainer rank 1 died during train_step"):
        run_job(config, tmp_path / "job", log=lambda *_: None, after_step=kill_rank_after(0))
    rows = (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [0]  # what was recorded stays
    assert events(tmp_path / "job")[-1] == "actor_failed"


def test_a_rollout_call_past_its_timeout_fails_the_job_naming_the_field(
        ray_cluster: None, tmp_path: Path) -> None:
    config = load_job_config(ROOT / "configs" / "demo.yaml",
                             [*SMALL, "num_steps=2", "max_restarts=0",
                              "rollout.call_timeout_s=0.000001"])
    with pytest.raises(JobFailed, match=r"rollout \w+ took longer than "
                                        r"rollout.call_timeout_s=1e-06 s"):
        run_job(config, tmp_path / "job", log=lambda *_: None)
    assert events(tmp_path / "job")[-1] == "actor_failed"
