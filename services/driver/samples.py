"""samples.jsonl: what the policy wrote, as text, one JSON object per sample.

    {"step", "group", "prompt", "response", "label", "reward", "rewards": {part: value},
     "advantage", "response_tokens", ...}

Each line is a :class:`rollout.sample_record.SampleRecord` (its ``to_json``, which spells
the keys). Training samples: the first ``logging.samples_per_step`` of each rollout step
(the rollout manager hands them on as ``RolloutBatch.samples``), with the advantage they were
trained with (the mean over the sample's response tokens of A_it, after GAE in a PPO
job). Evaluation samples: every one, ``"eval": true``, ``step`` the weight version,
``greedy`` or sampled. ``prompt`` is the prompt as the policy saw it (its chat
template's text), ``record_prompt`` as the dataset holds it. A resume drops the rows
after its checkpoint, as for metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.batch import RolloutBatch
from rollout.confined import read_inside
from rollout.sample_record import SampleRecord
from services.driver.run_dir import open_append


def with_advantages(batch: RolloutBatch) -> list[SampleRecord]:
    """The batch's sample records, each with its advantage: mean of A_it over the
    sample's valid tokens (0 with none)."""
    records = []
    for record in batch.samples:  # a few rows: their masks only, not the batch's
        i = int(record.index)
        valid = batch.loss_mask[i] > 0
        count = int(valid.sum())
        advantage = float(batch.advantages[i][valid].double().sum()) / count if count else 0.0
        records.append(dataclasses.replace(record, advantage=advantage))
    return records


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def append_samples(path: Path, records: Sequence[SampleRecord | dict[str, Any]]) -> None:
    """Append ``records`` to samples.jsonl (opened per write: a resume may have replaced
    the file), never through a link (run_dir.open_append); a dict is a line as read back
    (read_samples)."""
    if not records:
        return
    rows = [r.to_json() if isinstance(r, SampleRecord) else r for r in records]
    with open_append(path) as out:
        out.write("".join(json.dumps(_clean(r), ensure_ascii=False) + "\n" for r in rows))


def read_samples(path: Path, step: int | None = None, evaluation: bool | None = None
                 ) -> list[dict[str, Any]]:
    """The records of samples.jsonl (of rollout step ``step``; ``evaluation``: only the
    evaluation's, or only training's); a torn last line is skipped. Read without
    following a link (Escapes for one)."""
    if not path.exists() and not path.is_symlink():
        return []
    rows = []
    for line in read_inside(path.parent, path.name, str(path)).decode("utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if step is not None and row.get("step") != step:
            continue
        if evaluation is not None and bool(row.get("eval")) != evaluation:
            continue
        rows.append(row)
    return rows
