"""Prompt datasets: built-in synthetic tasks and math word problems, records from a local
JSONL / Parquet file, or a reasoning-gym dataset (when that optional package is installed).

A record has a prompt (a string, or a list of chat messages ``{"role", "content"}``),
an optional label (the reference answer, kept as a string) and free metadata that is
handed to the reward function untouched. Files are read as a stream of rows, one reader
for the job and for :func:`check_prompt_dataset` (the check before anything starts), and
every error is one line ``dataset.<field>: <file>:<line>: what is wrong; how to fix it``
(JSONL lines 1-based, Parquet rows 0-based).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.config import (
    DatasetConfig,
    FileDatasetConfig,
    MathWordsDatasetConfig,
    ReasoningGymDatasetConfig,
    SyntheticDatasetConfig,
)
from rollout.math_words import make_math_word_problems, math_word_prompt
from rollout.splits import HELDOUT_PERCENT, split_by_fraction, split_of
from rollout.tasks import make_task_examples

Prompt = str | list[dict[str, str]]


class DatasetError(ValueError):
    """A dataset that cannot be read; the message names the file and line or row."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of the dataset, with what its reward needs."""

    prompt: Prompt
    label: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def load_prompt_dataset(config: DatasetConfig) -> list[PromptRecord]:
    """All records of the configured dataset, in file (or generation) order."""
    if isinstance(config, SyntheticDatasetConfig):
        examples = make_task_examples(
            config.task, config.difficulty, config.seed, config.num_prompts
        )
        return [
            PromptRecord(e.prompt, e.answer, {"task": config.task, "difficulty": config.difficulty})
            for e in examples
        ]
    if isinstance(config, MathWordsDatasetConfig):
        return _math_word_records(config)
    if isinstance(config, ReasoningGymDatasetConfig):
        return _reasoning_gym_records(config)
    path = dataset_file(config)
    records = [record for record, _ in _file_records(path, config)]
    if not records:
        raise _no_records(path)
    if config.split_fraction is None:
        return records
    side = [r for r in records
            if split_by_fraction(_canonical(r.prompt), config.split_fraction) == config.split]
    if not side:
        raise DatasetError(f"{path}: no {config.split} records with split_fraction "
                           f"{config.split_fraction:g} ({len(records)} in the file)")
    return side


def _canonical(prompt: Any) -> str:
    """The text a record's split is decided by (chat messages as canonical JSON)."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _math_word_records(config: MathWordsDatasetConfig) -> list[PromptRecord]:
    problems = make_math_word_problems(
        config.difficulties, config.num_prompts, config.seed, config.split
    )
    return [
        PromptRecord(
            [{"role": "user", "content": math_word_prompt(p, config.answer_format)}],
            str(p.answer),
            {"task": "math_words", "difficulty": p.difficulty},
        )
        for p in problems
    ]


def check_dataset_available(config: DatasetConfig) -> None:
    """Raise DatasetError when the dataset needs a package this environment lacks (run at
    submit time, so a job fails before any actor starts)."""
    if isinstance(config, ReasoningGymDatasetConfig):
        _import_reasoning_gym()


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym  # optional, never a dependency of tally
    except ImportError as e:
        raise DatasetError(
            "dataset.type: 'reasoning_gym' needs the reasoning-gym package, which is not "
            "installed here (pip install reasoning-gym)"
        ) from e
    return reasoning_gym


def _reasoning_gym_records(config: ReasoningGymDatasetConfig) -> list[PromptRecord]:
    """``num_prompts`` distinct questions of the split, drawn in reasoning-gym's order.

    reasoning-gym has no splits of its own, so questions are split by the hash of their
    text (rollout/splits.py) and enough are drawn for the held-out share to fill up.
    """
    reasoning_gym = _import_reasoning_gym()
    share = HELDOUT_PERCENT if config.split == "heldout" else 100 - HELDOUT_PERCENT
    num_draws = config.num_prompts * 200 // share + 64
    try:
        entries = reasoning_gym.create_dataset(config.name, size=num_draws, seed=config.seed)
    except Exception as e:  # an unknown name, a dataset that refuses the size
        raise DatasetError(f"dataset.name: reasoning-gym cannot build {config.name!r} ({e})") from e
    records: list[PromptRecord] = []
    seen: set[str] = set()
    for entry in entries:
        question = str(entry["question"])
        if question in seen or split_of(question) != config.split:
            continue
        seen.add(question)
        metadata = {"task": "reasoning_gym", "name": config.name,
                    "reasoning_gym": entry.get("metadata", {})}
        records.append(PromptRecord([{"role": "user", "content": question}],
                                    str(entry["answer"]), metadata))
        if len(records) == config.num_prompts:
            return records
    raise DatasetError(
        f"dataset.num_prompts: reasoning-gym's {config.name!r} gave only {len(records)} "
        f"distinct {config.split} questions in {num_draws} draws; ask for fewer"
    )


# ---- files: one streaming reader of rows, for the job and for the check --------------

CHECK_MAX_BYTES = 256 * 2**20
""":func:`check_prompt_dataset` reads at most this much of a file (every record of a file
of reasonable size), ..."""
CHECK_MAX_S = 5.0
"""... and for at most this long; then it says how much it checked."""
DEFAULT_LABEL_KEYS = ("label", "answer")
"""Where the label is read from when ``label_key`` is left at its default."""
MAX_FIELDS_LISTED = 20
"""An error about a record names at most this many of its fields."""


@dataclass(frozen=True)
class DatasetCheck:
    """How much of a dataset file :func:`check_prompt_dataset` read (every record of it,
    unless it stopped at CHECK_MAX_BYTES or CHECK_MAX_S)."""

    path: Path
    num_records: int
    num_bytes_read: int
    num_bytes: int
    seconds: float

    @property
    def complete(self) -> bool:
        return self.num_bytes_read >= self.num_bytes

    def note(self) -> str | None:
        """None when every record was checked; else one line saying what was not."""
        if self.complete:
            return None
        return (f"dataset.path: checked the first {self.num_records:,} records of "
                f"{self.path} ({_mib(self.num_bytes_read)} of {_mib(self.num_bytes)} in "
                f"{self.seconds:.1f} s); the rest is checked as the job reads it")


def check_prompt_dataset(config: DatasetConfig, max_bytes: int | None = None,
                         max_seconds: float | None = None) -> DatasetCheck | None:
    """The check before anything starts: the packages the dataset needs and, for a file,
    every record's fields as the job will read them, up to ``max_bytes`` (CHECK_MAX_BYTES)
    and ``max_seconds`` (CHECK_MAX_S). Raises DatasetError naming the field and file:line;
    None for a generated dataset."""
    check_dataset_available(config)
    if not isinstance(config, FileDatasetConfig):
        return None
    max_bytes = CHECK_MAX_BYTES if max_bytes is None else max_bytes
    max_seconds = CHECK_MAX_S if max_seconds is None else max_seconds
    path = dataset_file(config)
    num_bytes, start = path.stat().st_size, time.monotonic()
    num_records = offset = 0
    for _, offset in _file_records(path, config):
        num_records += 1
        if offset >= max_bytes or (num_records % 256 == 0
                                   and time.monotonic() - start > max_seconds):
            break
    if not num_records:
        raise _no_records(path)
    return DatasetCheck(path, num_records, offset, num_bytes, time.monotonic() - start)


def dataset_file(config: FileDatasetConfig) -> Path:
    """The dataset's file; DatasetError naming ``dataset.path`` when there is none."""
    given = Path(config.path).expanduser()
    if given.is_file():
        return given
    looked = "" if given.is_absolute() else f" (looked for {given.resolve()})"
    if given.is_dir():
        raise DatasetError(f"dataset.path: {config.path} is a folder{looked}; name the "
                           f"{config.type.upper()} file inside it")
    raise DatasetError(f"dataset.path: {config.path} does not exist or is not a file{looked}")


def label_keys(config: FileDatasetConfig) -> tuple[str, ...]:
    """The fields a record's label is read from, first present wins: ``label_key`` when
    set, and left at its default ("label") also "answer" (what most datasets call it)."""
    if config.label_key is None:
        return ()
    return (config.label_key,) if "label_key" in config.model_fields_set else DEFAULT_LABEL_KEYS


def _no_records(path: Path) -> DatasetError:
    return DatasetError(f"dataset.path: {path} has no records (empty file); a JSONL file "
                        "holds one JSON object per line")


def _file_records(path: Path, config: FileDatasetConfig) -> Iterator[tuple[PromptRecord, int]]:
    """(record, bytes read so far) for each row of the file, in order."""
    rows = _jsonl_rows(path) if config.type == "jsonl" else _parquet_rows(path)
    keys = label_keys(config)
    for where, row, offset in rows:
        yield _to_record(row, config, keys, where), offset


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any, int]]:
    offset = 0
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            offset += len(raw)
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"dataset.path: {where}: not UTF-8 text (byte "
                                   f"{e.start + 1} of the line); save the file as UTF-8") from None
            if not line.strip():
                continue  # blank lines (a trailing newline) are not records
            try:
                row = json.loads(line.rstrip("\r\n"))  # columns stay on this line
            except json.JSONDecodeError as e:
                raise DatasetError(f"dataset.path: {where}: invalid JSON ({e.msg} at column "
                                   f"{e.colno}); each line holds one JSON object") from None
            yield where, row, offset


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any, int]]:
    try:
        import pyarrow.parquet as pq  # optional dependency (tally[data]): Parquet users only
    except ImportError:
        raise DatasetError("dataset.type: 'parquet' needs pyarrow, which is not installed "
                           "here (pip install 'tally[data]')") from None
    try:
        file = pq.ParquetFile(path)
        batches = file.iter_batches(batch_size=1024)
        num_rows, num_bytes = max(1, file.metadata.num_rows), path.stat().st_size
        index = 0
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            for row in batch.to_pylist():
                index += 1
                yield f"{path} row {index - 1}", row, num_bytes * index // num_rows
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        text = str(e).strip().splitlines()
        raise DatasetError(f"dataset.path: {path}: not a readable Parquet file "
                           f"({text[0] if text else type(e).__name__})") from None


def _to_record(row: Any, config: FileDatasetConfig, keys: tuple[str, ...],
               where: str) -> PromptRecord:
    if not isinstance(row, dict):
        raise DatasetError(f"dataset.path: {where}: expected a JSON object, got "
                           f"{type(row).__name__}")
    if config.prompt_key not in row:
        raise DatasetError(f"dataset.prompt_key: {where}: no field {config.prompt_key!r}; "
                           f"fields are {_fields(row)}; set prompt_key to the field holding "
                           "the prompt")
    prompt = row[config.prompt_key]
    if not _is_prompt(prompt):
        raise DatasetError(
            f"dataset.prompt_key: {where}: field {config.prompt_key!r} must be a non-empty "
            f"string or a list of {{'role', 'content'}} messages, got {prompt!r:.40}")
    used = next((key for key in keys if row.get(key) is not None), None)
    if keys and used is None:
        named = " or ".join(repr(k) for k in keys)
        null = [k for k in keys if k in row]
        default = " (the default label fields)" if len(keys) > 1 else ""
        what = f"field {null[0]!r} is null" if null else f"no field {named}{default}"
        raise DatasetError(
            f"dataset.label_key: {where}: {what}; fields are {_fields(row)}; set "
            "label_key to the field holding the reference answer, or to null if the reward "
            "needs no label")
    label = None
    if used is not None:
        value = row[used]
        label = value if isinstance(value, str) else json.dumps(value)
    if config.metadata_keys is None:
        skip = {config.prompt_key, used}
        metadata = {k: v for k, v in row.items() if k not in skip}
    else:
        missing = [k for k in config.metadata_keys if k not in row]
        if missing:
            raise DatasetError(f"dataset.metadata_keys: {where}: missing metadata field(s) "
                               f"{missing}; fields are {_fields(row)}")
        metadata = {k: row[k] for k in config.metadata_keys}
    return PromptRecord(prompt, label, metadata)


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _fields(row: dict[str, Any]) -> str:
    names = [repr(str(k)) for k in sorted(row, key=str)]
    more = [f"… {len(names) - MAX_FIELDS_LISTED} more"] if len(names) > MAX_FIELDS_LISTED else []
    return f"[{', '.join(names[:MAX_FIELDS_LISTED] + more)}]"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"
