"""A resume whose newest checkpoint is unreadable falls back to the one before it, on real
Ray, and says so in the job's events."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.config import load_job_config
from services.driver.loop import run_job
from tests.services.controller_fakes import DEMO_OVERRIDES
from tests.services.test_train import ROOT
from trainer.checkpoint import TRAINER_STATE

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def data_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path_factory.getbasetemp() / "tally-data"
    monkeypatch.setenv("TALLY_DATA_DIR", str(path))
    return path


def test_newest_checkpoint_unreadable_resumes_from_the_previous(ray_cluster: None,
                                                                 tmp_path: Path) -> None:
    def job(num_steps: int):
        overrides = [o for o in DEMO_OVERRIDES if not o.startswith("num_steps")]
        return load_job_config(ROOT / "configs" / "demo.yaml",
                               [*overrides, f"num_steps={num_steps}", "checkpoint_every=1"])

    out = tmp_path / "job"
    run_job(job(2), out, log=lambda *_: None)
    newest = out / "checkpoints" / "step_00000001" / TRAINER_STATE
    newest.write_bytes(newest.read_bytes()[:100])  # a disk that filled up mid-write
    resumed = run_job(job(3), out, log=lambda *_: None)
    assert len(resumed) == 2  # steps 2 and 3 again, from step_00000000
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    skipped = [e["message"] for e in events if e["kind"] == "checkpoint_unreadable"]
    assert len(skipped) == 1 and skipped[0].startswith("step_00000001: ")
    rows = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text()
            .splitlines()]
    assert rows == [0, 1, 2]
