"""The driver's part of a checkpoint is data: rollouts in flight round-trip through
safetensors + JSON exactly, and a rollouts file that holds a pickle is refused unrun —
the resume falls back to the checkpoint before it and says so."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import PretrainedConfig

from rollout.batch import RolloutBatch
from services.driver.checkpoint import (
    ROLLOUTS_IN_FLIGHT,
    DriverState,
    load_driver_state,
    newest_readable,
    save_driver_state,
    unreadable,
)
from services.driver.run_dir import RunDir
from tests.trainer.test_checkpoint_safe import Payload  # unpickling it runs os.mkdir
from trainer.checkpoint import commit_checkpoint, save_trainer_checkpoint, staging_path
from trainer.checkpoint_check import FOLDER_MANIFEST


def rollout(first_group: int) -> RolloutBatch:
    """A rollout with advantages that differ per token and fractional weights."""
    batch = RolloutBatch.from_samples(
        prompt_ids=[[1, 2], [1, 2], [3], [3]], response_ids=[[4, 5], [6], [7, 8, 9], [2]],
        response_log_probs=[[-0.5, -1.25], [-2.0], [-0.1, -0.2, -0.3], [-4.0]],
        rewards=[1.0, 0.0, 0.5, 0.25],
        advantages=[[0.5, 0.25], [-0.5], [0.125, 3.0, -1.5], [-0.125]],
        group_index=[first_group] * 2 + [first_group + 1] * 2, samples_per_prompt=2,
        pad_token_id=0, response_masks=[[1, 0.5], [1], [1, 0, 0.25], [0]],
        metadata={"rollout/weight_version": 3.0, "rollout/gen_start_time": 1.7e9},
        events=[("environment_failed", "rollout step 4: Game.step: ValueError: x")])
    return batch.with_old_log_probs(torch.randn(batch.input_ids.shape))


def write_checkpoint(run_dir: RunDir, step: int, in_flight: dict[int, RolloutBatch]) -> Path:
    staging = staging_path(run_dir.checkpoints_dir, step)
    save_trainer_checkpoint(str(staging), str(run_dir.path), SimpleNamespace(
        config=PretrainedConfig()), {"w": torch.full((2,), float(step))}, {"step": step})
    save_driver_state(staging, DriverState(step, {"cursor": {"position": step}}, in_flight))
    return commit_checkpoint(run_dir.checkpoints_dir, step)


def test_rollouts_in_flight_round_trip_exactly(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).create()
    saved = {4: rollout(8), 5: rollout(10)}
    folder = write_checkpoint(run_dir, 3, saved)
    assert unreadable(folder) is None
    state = load_driver_state(folder)
    assert state.step == 3 and state.rollout == {"cursor": {"position": 3}}
    assert sorted(state.in_flight) == [4, 5]
    for step, batch in saved.items():
        for field in fields(RolloutBatch):
            got, want = getattr(state.in_flight[step], field.name), getattr(batch, field.name)
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want), field.name
            else:
                assert got == want, field.name


def test_a_pickled_rollouts_file_is_refused_unrun_and_the_previous_checkpoint_used(
        tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).create()
    older = write_checkpoint(run_dir, 1, {2: rollout(4)})
    newer = write_checkpoint(run_dir, 2, {3: rollout(6)})
    marker = tmp_path / "ran"
    torch.save({3: Payload(marker)}, newer / ROLLOUTS_IN_FLIGHT)  # the old format: a pickle
    (newer / FOLDER_MANIFEST).unlink()  # …which had no folder manifest to catch it first
    reason = unreadable(newer)
    assert reason is not None and "never a pickle" in reason and ROLLOUTS_IN_FLIGHT in reason
    lines: list[str] = []
    assert newest_readable(run_dir, lines.append) == older
    assert not marker.exists()
    events = [json.loads(line) for line in run_dir.events_file.read_text().splitlines()]
    assert [e["kind"] for e in events] == ["checkpoint_unreadable"]
    assert events[0]["message"].startswith("step_00000002: ") and "never a pickle" in lines[0]


def test_a_torn_driver_state_is_named(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).create()
    folder = write_checkpoint(run_dir, 1, {})
    (folder / "driver_state.json").write_text("{torn")
    assert "driver_state.json: 5 bytes" in (unreadable(folder) or "")
    assert newest_readable(run_dir, lambda _: None) is None


def test_a_driver_state_changed_at_its_size_is_found_and_the_one_before_used(
        tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).create()
    older = write_checkpoint(run_dir, 1, {2: rollout(4)})
    newer = write_checkpoint(run_dir, 2, {})
    listed = json.loads((newer / FOLDER_MANIFEST).read_text())["files"]
    assert {"driver_state.json", "trainer_state.pt", "model/model.safetensors",
            "model/config.json"} <= set(listed) and ROLLOUTS_IN_FLIGHT in json.loads(
        (older / FOLDER_MANIFEST).read_text())["files"]
    state = newer / "driver_state.json"
    state.write_text(state.read_text().replace('"step": 2', '"step": 7'))  # same size
    reason = unreadable(newer) or ""
    assert "driver_state.json" in reason and "CRC-32" in reason
    assert newest_readable(run_dir, lambda _: None) == older
    (older / FOLDER_MANIFEST).unlink()  # a checkpoint from before the manifest still loads
    assert unreadable(older) is None


def test_a_start_checks_sizes_and_checkpoint_verify_reads_every_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bit flipped inside a large shard keeps its size: the start's cheap check passes it,
    `tally checkpoint verify` reads it and names the shard (exit 2, the good checkpoint
    said ok); an edited manifest listing fails its digest; no checkpoint is one line."""
    from typer.testing import CliRunner

    from services.cli import app
    from tests.trainer.test_checkpoint_metadata import sharded_checkpoint
    from trainer import checkpoint_check
    from trainer.checkpoint import SHARDS_DIR

    job = tmp_path / "job"
    for step in (0, 1):
        sharded_checkpoint(staging_path(job / "checkpoints", step))
        commit_checkpoint(job / "checkpoints", step)
    newer = job / "checkpoints" / "step_00000001"
    (shard,) = (newer / SHARDS_DIR).glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    assert shard.name in (unreadable(newer) or "")  # a small shard's CRC is read at a start
    # as at 7 B, where a shard is GBs: the start reads no shard byte
    monkeypatch.setattr(checkpoint_check, "SMALL_FILE_BYTES", len(data))
    assert unreadable(newer) is None  # sizes only: no shard byte read at a start
    assert shard.name in (unreadable(newer, full=True) or "")

    result = CliRunner().invoke(app, ["checkpoint", "verify", str(job)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{newer}: ValueError: shards/{shard.name}: ")
    assert "CRC-32" in lines[0] and lines[1].startswith(f"{newer.parent / 'step_00000000'}: ok")
    older = newer.parent / "step_00000000"
    assert CliRunner().invoke(app, ["checkpoint", "verify", str(older)]).exit_code == 0

    manifest = json.loads((older / FOLDER_MANIFEST).read_text())
    manifest["files"]["driver_state.json"]["crc32"] += 1
    (older / FOLDER_MANIFEST).write_text(json.dumps(manifest))
    assert "its listing does not match its digest" in (unreadable(older) or "")

    result = CliRunner().invoke(app, ["checkpoint", "verify", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "no checkpoint here" in result.output
