"""Prompt datasets from JSONL / Parquet (and reasoning-gym), their error messages, and the
resumable cursor."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest

from rollout.config import FileDatasetConfig, ReasoningGymDatasetConfig, SyntheticDatasetConfig
from rollout.cursor import PromptCursor
from rollout.datasets import (
    DatasetError,
    PromptRecord,
    check_dataset_available,
    load_prompt_dataset,
)


def _write_jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_records_labels_and_metadata(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"question": "add 1 2=", "answer": 3, "source": "x", "id": 1}),
            "",  # blank lines are skipped
            json.dumps({"question": [{"role": "user", "content": "hi"}], "answer": "a", "id": 2}),
        ],
    )
    config = FileDatasetConfig(type="jsonl", path=path, prompt_key="question", label_key="answer")
    records = load_prompt_dataset(config)
    assert records[0] == PromptRecord("add 1 2=", "3", {"source": "x", "id": 1})
    assert records[1].prompt == [{"role": "user", "content": "hi"}]
    only_id = config.model_copy(update={"metadata_keys": ["id"]})
    assert load_prompt_dataset(only_id)[1].metadata == {"id": 2}


def test_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "a", "label": "b"}', '{"prompt": "c"'])
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}:2: invalid JSON \(Expecting"):
        load_prompt_dataset(FileDatasetConfig(type="jsonl", path=path))

    path = _write_jsonl(tmp_path / "e.jsonl", ['{"prompt": "a", "label": "b"}', '{"text": "c"}'])
    with pytest.raises(DatasetError) as info:
        load_prompt_dataset(FileDatasetConfig(type="jsonl", path=path))
    assert str(info.value) == (
        f"{path}:2: missing field 'prompt' (dataset.prompt_key); fields are ['text']"
    )
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(path))}:1: missing field 'answer' \(dataset"
    ):
        load_prompt_dataset(FileDatasetConfig(type="jsonl", path=path, label_key="answer"))
    with pytest.raises(DatasetError, match=r":1: missing metadata field\(s\) \['id'\]"):
        load_prompt_dataset(FileDatasetConfig(type="jsonl", path=path, metadata_keys=["id"]))

    empty = _write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(empty))}: no records \(empty file\)$"
    ):
        load_prompt_dataset(FileDatasetConfig(type="jsonl", path=empty))
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(
        DatasetError, match=rf"^dataset.path: {re.escape(str(missing))} does not exist"
    ):
        load_prompt_dataset(FileDatasetConfig(type="jsonl", path=missing))
    not_object = _write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(DatasetError, match=r":1: expected an object, got list"):
        load_prompt_dataset(FileDatasetConfig(type="jsonl", path=not_object))


def test_parquet_records_and_errors(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["cp a=", "cp b="], "label": ["a", "b"], "k": [1, 2]}), path)
    records = load_prompt_dataset(FileDatasetConfig(type="parquet", path=path))
    assert records == [PromptRecord("cp a=", "a", {"k": 1}), PromptRecord("cp b=", "b", {"k": 2})]
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(path))} row 0: missing field 'question'"
    ):
        load_prompt_dataset(FileDatasetConfig(type="parquet", path=path, prompt_key="question"))
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(bad))}: not a readable Parquet file"):
        load_prompt_dataset(FileDatasetConfig(type="parquet", path=str(bad)))


def test_synthetic_dataset_carries_task_labels() -> None:
    records = load_prompt_dataset(SyntheticDatasetConfig(task="reverse", num_prompts=5, seed=3))
    assert len(records) == 5
    assert all(r.label == r.prompt[4:-1][::-1] for r in records)
    assert records[0].metadata == {"task": "reverse", "difficulty": 1}


def test_reasoning_gym_without_the_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import` fails, installed or not
    config = ReasoningGymDatasetConfig(type="reasoning_gym", name="leg_counting")
    for call in (check_dataset_available, load_prompt_dataset):
        with pytest.raises(DatasetError, match=r"^dataset\.type: 'reasoning_gym' needs the "
                           r"reasoning-gym package.*\(pip install reasoning-gym\)$"):
            call(config)


def test_reasoning_gym_entries_become_split_records(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in with reasoning-gym's interface: create_dataset(name, size=, seed=) yields
    # {"question", "answer", "metadata"} entries (the package itself is not a dependency).
    def create_dataset(name: str, size: int, seed: int) -> list[dict]:
        if name != "sums":
            raise ValueError(f"Dataset '{name}' not registered")
        return [{"question": f"{seed}: {i} + 1 = ?", "answer": i + 1, "metadata": {"i": i}}
                for i in range(size)]

    monkeypatch.setitem(sys.modules, "reasoning_gym", types.SimpleNamespace(
        create_dataset=create_dataset))
    splits = {}
    for split in ("train", "heldout"):
        config = ReasoningGymDatasetConfig(type="reasoning_gym", name="sums", num_prompts=30,
                                           seed=4, split=split)
        records = load_prompt_dataset(config)
        assert len({r.prompt[0]["content"] for r in records}) == 30
        splits[split] = {r.prompt[0]["content"] for r in records}
    assert splits["train"].isdisjoint(splits["heldout"])
    assert records[0].metadata["task"] == "reasoning_gym" and "i" in records[0].metadata[
        "reasoning_gym"]
    assert records[0].label == str(records[0].metadata["reasoning_gym"]["i"] + 1)
    with pytest.raises(DatasetError, match=r"^dataset\.name: reasoning-gym cannot build 'x'"):
        load_prompt_dataset(ReasoningGymDatasetConfig(type="reasoning_gym", name="x"))


def test_cursor_epochs_and_exact_resume() -> None:
    cursor = PromptCursor(5, seed=1)
    first_epoch = cursor.take(5)
    assert sorted(first_epoch) == [0, 1, 2, 3, 4]
    second = cursor.take(3)
    assert cursor.epoch == 1 and sorted(second + cursor.take(2)) == [0, 1, 2, 3, 4]
    state = cursor.state_dict()
    expected = cursor.take(7)
    resumed = PromptCursor(5, seed=1)
    resumed.load_state_dict(state)
    assert resumed.take(7) == expected
    assert PromptCursor(4, shuffle=False).take(6) == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="cursor: saved for a dataset of 5 records, but this"):
        PromptCursor(6).load_state_dict(state)
