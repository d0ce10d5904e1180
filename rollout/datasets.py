"""Prompt datasets: built-in synthetic tasks and math word problems, records from a local
JSONL / Parquet file, or a reasoning-gym dataset (when that optional package is installed).

A record has a prompt (a string, or a list of chat messages ``{"role", "content"}``),
an optional label (the reference answer, kept as a string) and free metadata that is
handed to the reward function untouched. Every loading error names the file and the
line (JSONL, 1-based) or row (Parquet, 0-based) at fault.
"""

from __future__ import annotations

import json
import tempfile
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
from rollout.splits import HELDOUT_PERCENT, split_of
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
    path = Path(config.path).expanduser()
    if not path.is_file():
        raise DatasetError(f"dataset.path: {path} does not exist or is not a file")
    rows = _read_jsonl(path) if config.type == "jsonl" else _read_parquet(path)
    records = [_to_record(row, config, where) for where, row in rows]
    if not records:
        raise DatasetError(f"{path}: no records (empty file)")
    return records


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


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline) are not records
            where = f"{path}:{line_number}"
            try:
                rows.append((where, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
    return rows


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import datasets  # optional dependency (tally[data]); only Parquet users need it

    datasets.disable_progress_bars()
    # A throwaway cache: reading a local file should leave nothing in ~/.cache.
    with tempfile.TemporaryDirectory() as cache_dir:
        try:
            table = datasets.Dataset.from_parquet(
                str(path), keep_in_memory=True, cache_dir=cache_dir
            )
        except Exception as e:
            raise DatasetError(f"{path}: not a readable Parquet file ({e})") from e
        return [(f"{path} row {i}", row) for i, row in enumerate(table.to_list())]


def _to_record(row: Any, config: FileDatasetConfig, where: str) -> PromptRecord:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
    if config.prompt_key not in row:
        raise DatasetError(
            f"{where}: missing field {config.prompt_key!r} (dataset.prompt_key); "
            f"fields are {sorted(row)}"
        )
    prompt = row[config.prompt_key]
    if not _is_prompt(prompt):
        raise DatasetError(
            f"{where}: field {config.prompt_key!r} must be a non-empty string or a list of "
            f"{{'role', 'content'}} messages"
        )
    label = None
    if config.label_key is not None:
        if row.get(config.label_key) is None:
            raise DatasetError(
                f"{where}: missing field {config.label_key!r} (dataset.label_key; set it "
                f"to null if the reward needs no label)"
            )
        value = row[config.label_key]
        label = value if isinstance(value, str) else json.dumps(value)
    if config.metadata_keys is None:
        skip = {config.prompt_key, config.label_key}
        metadata = {k: v for k, v in row.items() if k not in skip}
    else:
        missing = [k for k in config.metadata_keys if k not in row]
        if missing:
            raise DatasetError(
                f"{where}: missing metadata field(s) {missing} (dataset.metadata_keys)"
            )
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
