"""Where each rollout step's metrics go: a local JSONL file (the source of truth),
TensorBoard event files, W&B when ``logging.wandb`` is set (``wandb_sink.py``), and, when
a controller is configured, the controller (``services/clients/controller.py``)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Protocol

from rollout.confined import create_owned, read_inside
from services.driver.run_dir import METRICS_FILE, TENSORBOARD_DIR, open_append


class MetricsSink(Protocol):
    """Takes one row per rollout step; never raises into training for a remote failure."""

    def write(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step: {"step", "time", "metrics"}; appended and flushed.

    A file replaced under it (``truncate_after`` on resume) is reopened before the next
    write, so no row goes to the old, unlinked file. Never opened through a link (a link
    planted in the job folder is refused: run_dir.open_append)."""

    def __init__(self, output_dir: Path, filename: str = METRICS_FILE) -> None:
        self.path = output_dir / filename
        self.file = open_append(self.path)

    def _reopen_if_replaced(self) -> None:
        try:
            replaced = os.lstat(self.path).st_ino != os.fstat(self.file.fileno()).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:
            self.file.close()
            self.file = open_append(self.path)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._reopen_if_replaced()
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, "time": time.time(), "metrics": clean}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Each row as one event holding every finite scalar (TensorBoard reads each value
    under its own tag, as from one ``add_scalar`` per metric, which took 5.5 ms a row of
    160 metrics instead of 0.4)."""

    def __init__(self, output_dir: Path) -> None:
        from torch.utils.tensorboard.writer import FileWriter

        self.writer = FileWriter(str(output_dir / TENSORBOARD_DIR))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self.writer.add_summary(Summary(value=[
            Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()
            if math.isfinite(value)]), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl file; a torn last line (crash mid-write) is skipped.
    Read without following a link (Escapes for one: rollout/confined.py)."""
    rows = []
    if path.exists() or path.is_symlink():
        text = read_inside(path.parent, path.name, str(path)).decode("utf-8")
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def truncate_after(path: Path, step: int) -> None:
    """Drop rows of steps > step (a resume repeats them from the checkpoint), atomically:
    the kept rows go to a sibling file, fsynced, renamed over the original, so a crash
    leaves either the old file or the new one, never a half-written one. The sibling is a
    new file (O_EXCL|O_NOFOLLOW), so a link planted at its name is never written through."""
    if not path.exists() and not path.is_symlink():
        return
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    staging = path.with_name(path.name + ".truncating")
    staging.unlink(missing_ok=True)  # a crash's leftover, or a planted link: removed
    with os.fdopen(create_owned(staging, 0o644), "w", encoding="utf-8") as out:
        out.write("".join(json.dumps(r) + "\n" for r in rows))
        out.flush()
        os.fsync(out.fileno())
    os.replace(staging, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
