"""Checkpoint retention on real committed folders: the newest k, the final and the
best-evaluated checkpoint stay; the rest go."""

from __future__ import annotations

import json
from pathlib import Path

from services.driver.retention import best_eval_step, retire_checkpoints
from trainer.checkpoint import checkpoint_step, checkpoints, commit_checkpoint, staging_path


def commit(root: Path, step: int) -> None:
    staging = staging_path(root, step)
    staging.mkdir(parents=True)
    (staging / "driver_state.json").write_text(json.dumps({"step": step}))
    commit_checkpoint(root, step)


def steps(root: Path) -> list[int]:
    return sorted(checkpoint_step(path) for path in checkpoints(root))


def test_keep_last_two_leaves_two_step_folders_plus_final(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in range(6):
        commit(root, step)
        retire_checkpoints(root, 2, final_step=9, best_step=None)
    assert steps(root) == [4, 5]
    for step in (6, 7, 8, 9):
        commit(root, step)
        retire_checkpoints(root, 2, final_step=9, best_step=None)
    assert steps(root) == [8, 9]
    for step in (10, 11):  # a resume that trains past the old end keeps the old final too
        commit(root, step)
        retire_checkpoints(root, 2, final_step=9, best_step=None)
    assert steps(root) == [9, 10, 11]


def test_the_best_evaluated_checkpoint_is_kept_and_zero_keeps_all(tmp_path: Path) -> None:
    evals = tmp_path / "eval.jsonl"
    rows = [(0, 0.1), (3, 0.7), (6, 0.4), (9, 0.7)]
    evals.write_text("\n".join(json.dumps({"eval/weight_version": v, "eval/accuracy": a})
                               for v, a in rows) + "\nnot json\n")
    assert best_eval_step(evals) == 8  # ties go to the newest; version v is step v - 1
    evals.write_text(json.dumps({"eval/weight_version": 3, "eval/accuracy": 0.9}))
    assert best_eval_step(evals) == 2
    assert best_eval_step(tmp_path / "missing.jsonl") is None
    root = tmp_path / "checkpoints"
    for step in range(7):
        commit(root, step)
        retire_checkpoints(root, 2, final_step=20, best_step=best_eval_step(evals))
    assert steps(root) == [2, 5, 6]
    for step in range(7, 9):
        commit(root, step)
        assert retire_checkpoints(root, 0, final_step=20, best_step=None) == []
    assert steps(root) == [2, 5, 6, 7, 8]
