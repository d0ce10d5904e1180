"""Trainer checkpoints load with ``torch.load(weights_only=True)``: the real trainer state
(optimizer, scheduler, torch/numpy/python RNG) round-trips, and a checkpoint file that
carries code is refused without running it. A commit never leaves a moment with neither
the old nor the new checkpoint; an unreadable one is named, so a resume can skip it."""

from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import PretrainedConfig

from trainer.checkpoint import (
    TRAINER_STATE,
    checkpoints,
    commit_checkpoint,
    load_trainer_checkpoint,
    save_trainer_checkpoint,
    staging_path,
    trainer_state,
)
from trainer.checkpoint_check import unreadable


def test_trainer_state_round_trips_with_weights_only(tmp_path: Path) -> None:
    weight = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    scheduler.step()
    np.random.seed(3)
    random.seed(4)
    state = trainer_state(optimizer.state_dict(), scheduler)
    save_trainer_checkpoint(str(tmp_path), str(tmp_path), SimpleNamespace(
        config=PretrainedConfig()), {"w": weight.detach()}, state)
    expected = (np.random.rand(3), random.random(), torch.rand(2))

    model_state, loaded = load_trainer_checkpoint(str(tmp_path))
    assert torch.equal(model_state["w"], weight.detach())
    np.random.set_state(loaded["rng"]["numpy"])
    random.setstate(loaded["rng"]["python"])
    torch.set_rng_state(loaded["rng"]["torch"])
    assert np.array_equal(np.random.rand(3), expected[0])
    assert random.random() == expected[1] and torch.equal(torch.rand(2), expected[2])
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, 3))], lr=1e-3)
    fresh.load_state_dict(loaded["optimizer"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])
    assert loaded["scheduler"]["last_epoch"] == 1


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_checkpoint_that_carries_code_is_refused_unrun(tmp_path: Path) -> None:
    save_trainer_checkpoint(str(tmp_path), str(tmp_path), SimpleNamespace(
        config=PretrainedConfig()), {"w": torch.zeros(1)}, {})
    marker = tmp_path / "ran"
    torch.save({"optimizer": Payload(marker)}, tmp_path / TRAINER_STATE)
    with pytest.raises(Exception, match="Weights only load failed"):
        load_trainer_checkpoint(str(tmp_path))
    assert not marker.exists()


def write_checkpoint(root: Path, step: int, value: float) -> Path:
    staging = staging_path(root, step)
    save_trainer_checkpoint(str(staging), str(root), SimpleNamespace(
        config=PretrainedConfig()), {"w": torch.full((2,), value)}, {"step": step})
    return commit_checkpoint(root, step)


def test_commit_replaces_a_checkpoint_and_never_leaves_neither(tmp_path: Path) -> None:
    first = write_checkpoint(tmp_path, 1, 1.0)
    stale = staging_path(tmp_path, 1)  # a failed write left a staging folder behind
    (stale / "junk").parent.mkdir(parents=True)
    (stale / "junk").write_text("x")
    assert not staging_path(tmp_path, 1).exists()  # asking for it again cleans it
    write_checkpoint(tmp_path, 1, 2.0)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == \
        ["step_00000001"]
    assert load_trainer_checkpoint(str(first))[0]["w"].tolist() == [2.0, 2.0]
    os.replace(first, first.with_name(first.name + ".old"))  # a crash between the renames
    assert checkpoints(tmp_path) == [first.with_name(first.name + ".old")]
    assert unreadable(checkpoints(tmp_path)[0]) is None


def test_unreadable_checkpoints_are_named_and_skipped(tmp_path: Path) -> None:
    older, newer = write_checkpoint(tmp_path, 1, 1.0), write_checkpoint(tmp_path, 2, 2.0)
    assert checkpoints(tmp_path) == [newer, older] and unreadable(newer) is None
    state = newer / TRAINER_STATE
    state.write_bytes(state.read_bytes()[:20])  # truncated
    assert unreadable(newer) is not None
    (older / "model" / "model.safetensors").write_bytes(b"{torn")
    assert unreadable(older) is not None
