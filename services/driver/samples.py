"""samples.jsonl: what the policy wrote, as text, one JSON object per sample.

    {"step", "group", "prompt", "response", "label", "reward", "rewards": {part: value},
     "advantage", "response_tokens", ...}

Each line is a :class:`rollout.sample_record.SampleRecord` (its ``to_json``, which spells
the keys). Training samples: ``logging.samples_per_step`` of each rollout step, whole
groups drawn at random (seeded by rollout.seed and the step, so a resumed run logs the
same ones; the last group drawn is cut to make the count: rollout/rollouts/step.py
``training_records``), handed on by the rollout manager as ``RolloutBatch.samples``, with
the advantage they were trained with (the mean over the sample's response tokens of A_it,
after GAE in a PPO job). Evaluation samples: every one, ``"eval": true``, ``step`` the
weight version, ``greedy`` or sampled. ``prompt`` is the prompt as the policy saw it (its
chat template's text), ``record_prompt`` as the dataset holds it.

The file is appended to, never rewritten on a write, but for two exceptions. Past
``logging.samples_max_mb`` it is thinned (:func:`thinned`, :func:`thin_samples`): each
round drops every other training step of the older half of the training steps present
(the oldest one kept, the newer half never touched), until it fits in ¾ of the bound (so
that thinning stays rare); only when one training step is left are the evaluations
thinned the same way (the newest kept). The kept lines then go to a sibling file renamed
over it. A resume drops the rows after its checkpoint, as for metrics.jsonl, by cutting
the file in place (services/driver/sinks.py ``truncate_after``: read line by line, never
held whole).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout.batch import RolloutBatch
from rollout.confined import open_inside, read_inside
from rollout.sample_record import SampleRecord
from services.driver.config import LoggingConfig
from services.driver.run_dir import open_append
from services.driver.sinks import rewrite_kept

MIB = 1 << 20
MAX_MB: float = LoggingConfig.model_fields["samples_max_mb"].default
"""logging.samples_max_mb's default: the bound of a caller that names none."""
THINNED_TO = 0.75
"""A file past its bound is thinned to this share of it: the next thinning is a quarter of
the bound of appends away, not the next append."""


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


def append_samples(path: Path, records: Sequence[SampleRecord | dict[str, Any]],
                   max_mb: float = MAX_MB) -> None:
    """Append ``records`` to samples.jsonl (opened per write: a resume may have replaced
    the file), never through a link (run_dir.open_append); a dict is a line as read back
    (read_samples). Past ``max_mb`` MiB (logging.samples_max_mb) the file is thinned."""
    if not records:
        return
    rows = [r.to_json() if isinstance(r, SampleRecord) else r for r in records]
    with open_append(path) as out:
        out.write("".join(json.dumps(_clean(r), ensure_ascii=False) + "\n" for r in rows))
        out.flush()
        size = os.fstat(out.fileno()).st_size
    if size > max_mb * MIB:
        thin_samples(path, int(max_mb * MIB * THINNED_TO))


def thinned(sizes: Mapping[tuple[bool, int], int], max_bytes: int) -> set[tuple[bool, int]]:
    """Which (evaluation, step) keys to drop so that the bytes left, ``sizes`` summed over
    the kept keys, fit ``max_bytes``. Rounds over the training steps, then the
    evaluations: of the n steps present, the older ⌊n/2⌋ are thinned, every other one
    dropped from the second on (the oldest kept; of two, the older goes), so the newest
    steps stay whole and the old ones grow sparse round by round. Stops short when only
    the newest training step and the newest evaluation are left."""
    kept = dict(sizes)
    total = sum(kept.values())
    dropped: set[tuple[bool, int]] = set()
    for evaluation in (False, True):
        while total > max_bytes:
            older = sorted(step for e, step in kept if e == evaluation)
            older = older[:len(older) // 2]
            doomed = older[1::2] or older
            if not doomed:
                break
            for step in doomed:
                total -= kept.pop((evaluation, step))
                dropped.add((evaluation, step))
    return dropped


def thin_samples(path: Path, max_bytes: int) -> None:
    """Thin samples.jsonl to ``max_bytes`` (:func:`thinned`), read line by line, never
    whole; the kept lines, as written, go to a sibling file (O_EXCL|O_NOFOLLOW, fsynced)
    renamed over it, so a crash leaves the old file or the new one and a link is never
    written through. A line that is not a sample (torn) is dropped with them."""
    with os.fdopen(open_inside(path.parent, path.name, str(path)), "rb") as file:
        sizes: dict[tuple[bool, int], int] = {}
        for line in file:
            if (key := _key(line)) is not None:
                sizes[key] = sizes.get(key, 0) + len(line)
        drop = thinned(sizes, max_bytes)
        if not drop:
            return
        rewrite_kept(file, path, ".thinning",
                     lambda line: (key := _key(line)) is not None and key not in drop)


def _key(line: bytes) -> tuple[bool, int] | None:
    """(evaluation, step) of a samples.jsonl line; None for a line that is not a sample."""
    try:
        row = json.loads(line)
    except ValueError:  # torn or garbled
        return None
    step = row.get("step") if isinstance(row, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    return bool(row.get("eval")), step


def read_samples(path: Path, step: int | None = None, evaluation: bool | None = None
                 ) -> list[dict[str, Any]]:
    """The records of samples.jsonl (of rollout step ``step``; ``evaluation``: only the
    evaluation's, or only training's); a torn last line is skipped. Read without
    following a link (Escapes for one)."""
    if not path.exists() and not path.is_symlink():
        return []
    rows = []  # lines end at "\n" only: a response may hold U+2028 or U+0085 as written
    for line in read_inside(path.parent, path.name, str(path)).decode("utf-8").split("\n"):
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
