"""The W&B sink logs what metrics.jsonl holds: an offline run, read back from its
transaction log (``<job>/wandb/offline-run-*/run-*.wandb``)."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from services.config.job import ConfigError, parse_job_config
from services.driver.sinks import JsonlSink, read_metrics
from services.driver.wandb_sink import wandb_sinks

ROWS = [
    {"reward/mean": 0.25, "reward/std": 0.4330127018922193, "pg_loss": -1.5e-08,
     "kl": float("nan"), "perf/tokens_per_s": 11416.0, "eval/accuracy/d1": 0.1},
    {"reward/mean": 0.5, "reward/std": 0.5, "pg_loss": 0.0, "kl": 0.0012,
     "perf/tokens_per_s": float("inf"), "eval/accuracy/d1": 1 / 3},
    {"reward/mean": 0.9375, "reward/std": 0.24206145913796356, "pg_loss": 2.0,
     "kl": 0.003, "perf/tokens_per_s": 12000.5, "eval/accuracy/d1": 0.75},
]

BLOCK_SIZE = 32 * 1024
"""The transaction log is LevelDB's log format: 32 KiB blocks of chunks, each with a
7-byte header (checksum, length, kind: 1 full, 2 first, 3 middle, 4 last); the file
starts with a 7-byte header of its own (``:W&B``, magic 0xBEE1, version 0)."""


def transaction_log_records(path: Path) -> list[Any]:
    """The Record protos of a .wandb file, each chunk's checksum verified (W&B's: CRC-32
    of the data, seeded with the CRC-32 of the kind byte)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0)
    records, chunks, pos = [], [], 7
    while pos + 7 <= len(data):
        if BLOCK_SIZE - pos % BLOCK_SIZE < 7:  # a block's tail too short for a header
            pos += BLOCK_SIZE - pos % BLOCK_SIZE
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += BLOCK_SIZE - pos % BLOCK_SIZE
            continue
        if pos + 7 + length > len(data):  # a tail wandb-core is still writing
            break
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum
        chunks.append(chunk)
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def finished_run_records(path: Path, timeout_s: float = 60.0) -> list[Any]:
    """The records of a run once its ``exit`` record is on disk: wandb-core writes the
    file in its own process and may still be flushing when ``finish()`` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = transaction_log_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout_s} s"
        time.sleep(0.1)


def history_of(records: list[Any]) -> dict[int, dict[str, float]]:
    """Step -> the metrics logged at it (W&B's own _step, _runtime, _timestamp left out)."""
    rows = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or ".".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            rows[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def test_offline_run_holds_every_metric_of_metrics_jsonl(wandb_home: Path) -> None:
    job_dir = wandb_home / "job"
    job_dir.mkdir()
    config = parse_job_config(
        "name: wandb-test\nlogging: {wandb: {project: tally-tests, mode: offline, "
        "tags: [ci]}}\n")
    [sink] = wandb_sinks(config.logging.wandb, job_dir, config.name,
                         config.model_dump(mode="json"))
    assert os.environ["WANDB_ERROR_REPORTING"] == "false"  # offline: no reports sent either
    jsonl = JsonlSink(job_dir)
    for step, metrics in enumerate(ROWS, start=1):
        jsonl.write(step, metrics)
        sink.write(step, metrics)
    sink.write(2, {"reward/mean": -1.0})  # a restart repeating step 2: W&B keeps the first
    jsonl.close()
    sink.close()

    [log] = job_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = finished_run_records(log)
    expected = {row["step"]: {k: v for k, v in row["metrics"].items() if v is not None}
                for row in read_metrics(job_dir / "metrics.jsonl")}
    assert history_of(records) == expected
    assert expected[2] == {k: v for k, v in ROWS[1].items() if math.isfinite(v)}

    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, list(run.tags)) == ("tally-tests", "wandb-test",
                                                               ["ci"])
    logged_config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert logged_config["logging"]["wandb"]["mode"] == "offline"
    assert logged_config["rollout"] == config.model_dump(mode="json")["rollout"]


def test_not_configured_or_disabled_is_no_sink(tmp_path: Path) -> None:
    assert wandb_sinks(None, tmp_path, "job", {}) == []
    disabled = parse_job_config("logging: {wandb: {project: p, mode: disabled}}\n")
    assert wandb_sinks(disabled.logging.wandb, tmp_path, "job", {}) == []
    assert not list(tmp_path.iterdir())


def test_configured_but_not_installed_names_the_field_and_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, installed or not
    config = parse_job_config("logging: {wandb: {project: p, mode: offline}}\n")
    with pytest.raises(ConfigError) as caught:
        wandb_sinks(config.logging.wandb, tmp_path, "job", {})
    [problem] = caught.value.problems
    assert problem.field == "logging.wandb"
    assert "pip install 'tally[wandb]'" in problem.message


def test_invalid_mode_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_job_config("logging: {wandb: {project: p, mode: offlne}}\n")
    [problem] = caught.value.problems
    assert problem.field == "logging.wandb.mode"
    assert "'offline'" in problem.message
