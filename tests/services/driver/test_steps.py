"""On real Ray: one step numbering everywhere (the progress line, metrics.jsonl,
updates.jsonl, TensorBoard, checkpoint names and `latest`), a resume that takes on a
new learning rate and num_steps and says so, the job folder described at the end; and an
actor that cannot start fails the job at once, saying why in one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from services.driver.loop import run_job
from services.train import train_from_cli
from tests.services.controller.fakes import DEMO_OVERRIDES
from tests.services.driver.clean_run import NUM_UPDATES, ROOT, CleanRun, clean_config, rows

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_gang_pool")]
"""Jobs in this process: each may take the gang the last one left (tests/conftest.py)."""


def events(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines()]


def test_step_numbers_agree_across_the_progress_line_rows_tensorboard_and_checkpoints(
        clean_run: CleanRun, tmp_path: Path) -> None:
    """The clean run (rollout steps 0-3) resumed for one more step, at a lower learning
    rate: the new step is step 4 in every place that names it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = tmp_path / "job"
    shutil.copytree(clean_run.path, job, symlinks=True)
    lines: list[str] = []
    (row,) = run_job(clean_config("num_steps=5", "trainer.optimizer.lr=1e-3"), job,
                     log=lines.append)
    progress = [line for line in lines if line.startswith("step ")]
    assert len(progress) == 1 and progress[0].startswith("step 4 (5/5 done) | reward "), lines
    assert all(f" | {name} " in progress[0] for name in ("kl", "entropy", "lr")), progress
    assert " | ETA " not in progress[0]  # the last step: nothing left
    assert any(line.startswith("job demo: rollout steps 4..4,") for line in lines), lines
    assert f"resumed from {job / 'checkpoints' / 'step_00000003'} (rollout step 3 done)" in (
        lines)
    assert [r["step"] for r in rows(job / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in rows(job / "updates.jsonl")] == list(range(5 * NUM_UPDATES))
    events_file = EventAccumulator(str(job / "tensorboard"), size_guidance={"scalars": 0})
    events_file.Reload()
    assert [s.step for s in events_file.Scalars("reward/mean")] == [0, 1, 2, 3, 4]
    checkpoints = job / "checkpoints"
    # checkpoint_keep_last 3: the newest three (the final among them); 0 and 1 retired.
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "latest", *(f"step_{s:08d}" for s in range(2, 5))]
    assert os.readlink(checkpoints / "latest") == "step_00000004"
    changed = [e["message"] for e in events(job) if e["kind"] == "config_changed"]
    assert changed == ["num_steps: 4 → 5", "trainer.optimizer.lr: 0.002 → 0.001"]
    # The job folder, described at the end.
    end = lines[lines.index(f"output: {job}"):]
    assert end[1] == "  metrics.jsonl        5 rows (one per rollout step)", end
    assert "  checkpoints/latest → step_00000004" in end
    assert not any(line.startswith("  eval.jsonl") for line in end)  # no evaluation
    assert any(line.startswith("  final_model/ ") for line in end), end
    assert any(line.startswith("  tensorboard/ ") for line in end), end
    assert row["lr"] == pytest.approx(1e-3)  # the resumed ranks use the new lr


def test_an_actor_that_cannot_start_fails_the_job_at_once_saying_why(
        ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A dataset file that is gone by the time the rollout manager reads it (preflight,
    which would refuse it, is left out here): no restart, though one is allowed; the
    last line and the actor_failed event say why in one line."""
    monkeypatch.setattr("services.train.preflight", lambda *_a, **_k: [])
    monkeypatch.setattr("services.driver.loop.preflight", lambda *_a, **_k: [])
    missing = tmp_path / "gone.jsonl"
    code = train_from_cli(ROOT / "configs" / "demo.yaml", [
        *DEMO_OVERRIDES, "max_restarts=1", f"rollout.dataset={{type: jsonl, path: {missing}}}"],
        tmp_path / "job")
    assert code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: job demo: the rollout manager failed to start: "), last
    assert str(missing) in last and "\x1b" not in last
    assert last.endswith("(not retried: a restart would raise it again)")
    kinds = [e["kind"] for e in events(tmp_path / "job")]
    assert "restart" not in kinds and kinds.count("actor_failed") == 1, kinds
    (failed,) = [e["message"] for e in events(tmp_path / "job") if e["kind"] == "actor_failed"]
    assert "\n" not in failed and failed in last
