"""A resume whose newest checkpoint is unreadable (a corrupted shard) falls back to the
one before it, on real Ray, says so in the job's events, and the job ends as the clean
run (tests/services/driver/clean_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.driver.loop import run_job
from tests.services.driver.clean_run import (
    CleanRun,
    Interrupted,
    assert_same_training,
    clean_config,
    rows,
    stop_after,
)
from trainer.checkpoint import SHARDS_DIR

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_gang_pool")]
"""The resume may take the gang the stopped run left."""


def test_newest_checkpoint_unreadable_resumes_exactly_from_the_previous(
        clean_run: CleanRun, tmp_path: Path) -> None:
    job = tmp_path / "job"
    with pytest.raises(Interrupted):
        run_job(clean_config(), job, log=lambda *_: None, after_step=stop_after(2))
    shard = job / "checkpoints" / "step_00000002" / SHARDS_DIR / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01  # rank 1's shard, one bit flipped on the disk
    shard.write_bytes(bytes(data))
    resumed = run_job(clean_config(), job, log=lambda *_: None)
    assert len(resumed) == 2  # steps 2 and 3 again, from step_00000001
    events = [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines()]
    skipped = [e["message"] for e in events if e["kind"] == "checkpoint_unreadable"]
    assert len(skipped) == 1 and skipped[0].startswith("step_00000002: ValueError: "
                                                       "shards/__1_0.distcp: "), skipped
    assert [r["step"] for r in rows(job / "metrics.jsonl")] == [0, 1, 2, 3]
    assert_same_training(job, clean_run)
