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
    check_prompt_dataset,
    label_keys,
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


def test_jsonl_errors_name_the_field_file_and_line(tmp_path: Path) -> None:
    def error(path: str, **fields: object) -> str:
        with pytest.raises(DatasetError) as info:
            load_prompt_dataset(FileDatasetConfig(type="jsonl", path=path, **fields))
        return str(info.value)

    path = _write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "a", "label": "b"}', '{"prompt": "c"'])
    assert re.match(rf"^dataset\.path: {re.escape(path)}:2: invalid JSON \(Expecting ",
                    error(path))
    assert error(path).endswith("; each line holds one JSON object")

    path = _write_jsonl(tmp_path / "e.jsonl", ['{"prompt": "a", "label": "b"}', '{"text": "c"}'])
    assert error(path) == (f"dataset.prompt_key: {path}:2: no field 'prompt'; fields are "
                           "['text']; set prompt_key to the field holding the prompt")
    assert error(path, label_key="answer") == (
        f"dataset.label_key: {path}:1: no field 'answer'; fields are ['label', 'prompt']; set "
        "label_key to the field holding the reference answer, or to null if the reward needs "
        "no label")
    assert error(path, metadata_keys=["id"]) == (
        f"dataset.metadata_keys: {path}:1: missing metadata field(s) ['id']; fields are "
        "['label', 'prompt']")

    empty = _write_jsonl(tmp_path / "empty.jsonl", [""])
    assert error(empty) == (f"dataset.path: {empty} has no records (empty file); a JSONL file "
                            "holds one JSON object per line")
    missing = str(tmp_path / "missing.jsonl")
    assert error(missing) == f"dataset.path: {missing} does not exist or is not a file"
    assert error(str(tmp_path)) == (f"dataset.path: {tmp_path} is a folder; name the JSONL "
                                    "file inside it")
    not_object = _write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    assert error(not_object) == f"dataset.path: {not_object}:1: expected a JSON object, got list"
    not_text = tmp_path / "latin1.jsonl"
    not_text.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert error(str(not_text)) == (f"dataset.path: {not_text}:1: not UTF-8 text (byte 16 of "
                                    "the line); save the file as UTF-8")
    bad_prompt = _write_jsonl(tmp_path / "p.jsonl", ['{"prompt": 7, "label": "b"}'])
    assert error(bad_prompt).startswith(
        f"dataset.prompt_key: {bad_prompt}:1: field 'prompt' must be a non-empty string or a "
        "list of {'role', 'content'} messages, got 7")


def test_the_default_label_field_is_label_else_answer(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [
        json.dumps({"prompt": "p1", "answer": 3, "id": 1}),
        json.dumps({"prompt": "p2", "label": "x", "answer": "y"}),
    ])
    records = load_prompt_dataset(FileDatasetConfig(type="jsonl", path=path))
    assert records == [PromptRecord("p1", "3", {"id": 1}), PromptRecord("p2", "x", {"answer": "y"})]
    explicit = FileDatasetConfig(type="jsonl", path=path, label_key="label")
    assert label_keys(explicit) == ("label",)  # set explicitly: only that field
    with pytest.raises(DatasetError, match=r":1: no field 'label'; fields are \['answer', 'id'"):
        load_prompt_dataset(explicit)
    assert load_prompt_dataset(explicit.model_copy(update={"label_key": None}))[0].label is None

    neither = _write_jsonl(tmp_path / "n.jsonl", [json.dumps({"prompt": "p", "solution": 1}),
                                                 json.dumps({"prompt": "p", "label": None})])
    with pytest.raises(DatasetError) as info:
        load_prompt_dataset(FileDatasetConfig(type="jsonl", path=neither))
    assert str(info.value) == (
        f"dataset.label_key: {neither}:1: no field 'label' or 'answer' (the default label "
        "fields); fields are ['prompt', 'solution']; set label_key to the field holding the "
        "reference answer, or to null if the reward needs no label")
    first_ok = _write_jsonl(tmp_path / "m.jsonl", [json.dumps({"prompt": "p", "label": None})])
    with pytest.raises(DatasetError, match=r":1: field 'label' is null; fields are"):
        load_prompt_dataset(FileDatasetConfig(type="jsonl", path=first_ok))


def test_the_check_reads_every_record_and_says_when_it_stopped(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": f"p{i}", "answer": i}) for i in range(2000)]
    path = _write_jsonl(tmp_path / "d.jsonl", [*lines[:-1], '{"prompt": "last"}'])
    config = FileDatasetConfig(type="jsonl", path=path)
    with pytest.raises(DatasetError, match=rf"^dataset\.label_key: {re.escape(path)}:2000: "):
        check_prompt_dataset(config)  # the last record of the file is read
    good = _write_jsonl(tmp_path / "good.jsonl", lines)
    checked = check_prompt_dataset(FileDatasetConfig(type="jsonl", path=good))
    assert checked is not None and checked.complete and checked.num_records == 2000
    assert checked.note() is None
    partly = check_prompt_dataset(FileDatasetConfig(type="jsonl", path=good), max_bytes=1000)
    assert partly is not None and not partly.complete
    assert re.fullmatch(rf"dataset\.path: checked the first {partly.num_records} records of "
                        rf"{re.escape(good)} \(0 MiB of 0 MiB in \d+\.\d s\); the rest is "
                        r"checked as the job reads it", partly.note() or "")
    slow = check_prompt_dataset(FileDatasetConfig(type="jsonl", path=good), max_seconds=0)
    assert slow is not None and slow.num_records == 256 and not slow.complete
    assert check_prompt_dataset(SyntheticDatasetConfig()) is None


def test_parquet_records_and_errors(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["cp a=", "cp b="], "label": ["a", "b"], "k": [1, 2]}), path)
    records = load_prompt_dataset(FileDatasetConfig(type="parquet", path=path))
    assert records == [PromptRecord("cp a=", "a", {"k": 1}), PromptRecord("cp b=", "b", {"k": 2})]
    with pytest.raises(
        DatasetError, match=rf"^dataset\.prompt_key: {re.escape(path)} row 0: no field 'question'"
    ):
        load_prompt_dataset(FileDatasetConfig(type="parquet", path=path, prompt_key="question"))
    checked = check_prompt_dataset(FileDatasetConfig(type="parquet", path=path))
    assert checked is not None and checked.complete and checked.num_records == 2
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DatasetError, match=rf"^dataset\.path: {re.escape(str(bad))}: not a "
                       r"readable Parquet file \(.+\)$"):
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
