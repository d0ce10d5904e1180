"""Checkpoint retention: which committed step folders a job keeps (``checkpoint_keep_last``).

    kept = the newest k step folders  ∪  the final one (step num_steps − 1)
           ∪  the best-evaluated one (highest ``eval/accuracy`` in eval.jsonl; a row of
              weights version v is checkpoint step_{v−1}, ties: the newest)

k = 0 keeps every checkpoint. Retention runs after each commit, so at most k + 2 step
folders exist at any moment; ``latest`` always points at a kept one (the newest).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from trainer import checkpoint as trainer_checkpoint

EVAL_METRIC = "eval/accuracy"
VERSION_KEY = "eval/weight_version"


def best_eval_step(eval_file: Path) -> int | None:
    """The checkpoint step whose weights evaluated best (None: no evaluation of trained
    weights yet). Unparseable rows are skipped: retention never fails a job."""
    if not eval_file.is_file():
        return None
    best: tuple[float, int] | None = None
    for line in eval_file.read_text().splitlines():
        try:
            row = json.loads(line)
            score, version = float(row[EVAL_METRIC]), int(row[VERSION_KEY])
        except (ValueError, KeyError, TypeError):
            continue
        if version >= 1 and (best is None or (score, version) >= best):
            best = (score, version)
    return None if best is None else best[1] - 1


def retire_checkpoints(root: Path, keep_last: int, final_step: int,
                       best_step: int | None) -> list[Path]:
    """Delete the committed step folders of ``root`` that the rule above does not keep;
    returns what was deleted (oldest first)."""
    if keep_last <= 0:
        return []
    found = trainer_checkpoint.checkpoints(root)  # newest first
    protected = {final_step, best_step}
    doomed = [path for path in found[keep_last:]
              if trainer_checkpoint.checkpoint_step(path) not in protected]
    for path in reversed(doomed):
        shutil.rmtree(path, ignore_errors=True)
    return list(reversed(doomed))
