"""DCP's ``shards/.metadata`` is a pickle: it is read through a restricted unpickler, so
a real one loads and one that carries code is refused unrun — by ``tally train --resume``
and ``tally export`` alike, with exit code 2 and one line naming the file, before Ray or
any actor starts."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed import checkpoint as dcp
from transformers import PretrainedConfig
from typer.testing import CliRunner

from services.cli import app
from services.driver.checkpoint import DRIVER_STATE
from trainer.checkpoint import (
    MANIFEST,
    MODEL_CONFIG_DIR,
    SHARDS_DIR,
    TRAINER_STATE,
    read_sharded_whole,
)
from trainer.checkpoint_check import _digest
from trainer.dcp_metadata import UnsafeMetadata, load_metadata

ROOT = Path(__file__).resolve().parents[2]


def sharded_checkpoint(folder: Path) -> Path:
    """A real sharded checkpoint, written by DCP on one process (no process group)."""
    weight = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    shards = folder / SHARDS_DIR
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": {"w": weight.detach()},
                  "optimizer": {"state": {"w": optimizer.state_dict()["state"][0]},
                                "param_groups": [{"lr": 1e-3, "params": ["w"]}]}},
                 checkpoint_id=str(shards), no_dist=True)
    files = {f.name: _digest(f) for f in shards.iterdir()}
    (shards / MANIFEST).write_text(json.dumps({"files": files}))
    torch.save({"scheduler": {}}, folder / TRAINER_STATE)
    PretrainedConfig().save_pretrained(folder / MODEL_CONFIG_DIR)
    (folder / DRIVER_STATE).write_text(json.dumps({"step": 0, "rollout": {}}))
    return folder


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_real_metadata_loads_through_the_restricted_unpickler(tmp_path: Path) -> None:
    folder = sharded_checkpoint(tmp_path / "step_00000000")
    state = read_sharded_whole(folder)
    assert state["model"]["w"].shape == (4, 3)
    assert state["optimizer"]["state"]["w"]["exp_avg"].shape == (4, 3)
    with pytest.raises(UnsafeMetadata, match=r"shards/.metadata: refuses posix.mkdir"):
        load_metadata(pickle.dumps(Payload(tmp_path / "ran")))
    assert not (tmp_path / "ran").exists()


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("poisoned")
    folder = sharded_checkpoint(root / "job" / "checkpoints" / "step_00000000")
    marker = root / "ran"
    metadata = folder / SHARDS_DIR / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    manifest = json.loads((folder / SHARDS_DIR / MANIFEST).read_text())
    manifest["files"][".metadata"] = _digest(metadata)  # whoever crafts it fixes the sums
    (folder / SHARDS_DIR / MANIFEST).write_text(json.dumps(manifest))
    return folder, marker


def test_export_refuses_a_metadata_that_carries_code(poisoned: tuple[Path, Path],
                                                     tmp_path: Path) -> None:
    folder, marker = poisoned
    result = CliRunner().invoke(app, ["export", str(folder), str(tmp_path / "hf")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().count("\n") == 0
    assert "shards/.metadata: refuses posix.mkdir" in result.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_resume_refuses_a_metadata_that_carries_code_before_ray(
        poisoned: tuple[Path, Path], tmp_path: Path) -> None:
    folder, marker = poisoned
    result = CliRunner().invoke(app, [
        "train", str(ROOT / "configs" / "demo.yaml"), "--resume", str(folder),
        "--output-dir", str(tmp_path / "job")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "shards/.metadata: refuses posix.mkdir" in lines[0], lines
    assert not marker.exists()
