"""Where each rollout step's metrics go: a local JSONL file (the source of truth),
TensorBoard event files, W&B when ``logging.wandb`` is set (``wandb_sink.py``), and, when
a controller is configured, the controller (``services/clients/controller.py``)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

from rollout.confined import create_owned, open_inside, read_inside
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
    """Drop the rows of steps > ``step`` (a resume repeats them from the checkpoint) and
    every line that is not a row (a torn line), reading the file line by line, never whole
    (samples.jsonl may hold many MB).

    Rows are appended in step order, so the dropped lines are the file's tail: the file
    is cut in place at the first of them (one ftruncate, on a descriptor opened without
    following a link; a crash leaves the old length or the new, and a sink appending to
    it goes on at the new end). Where a kept row follows a dropped line (an evaluation's
    samples written late, a torn line mid-file), the kept lines are copied as written to
    a sibling file, fsynced and renamed over the original, so a crash leaves the old file
    or the new one; the sibling is a new file (O_EXCL|O_NOFOLLOW), never written through a
    link planted at its name. A kept last row that lost its newline gets it back."""
    if not path.exists() and not path.is_symlink():
        return
    with os.fdopen(open_inside(path.parent, path.name, str(path), os.O_RDWR), "r+b") as file:
        cut, kept_after_cut, open_end = None, False, False
        offset = 0
        for line in file:
            if _kept(line, step):
                kept_after_cut = kept_after_cut or cut is not None
                open_end = not line.endswith(b"\n")
            elif cut is None:
                cut = offset
            offset += len(line)
        if kept_after_cut:
            _copy_kept(file, path, step)
            return
        if cut is not None:
            os.ftruncate(file.fileno(), cut)
        elif open_end:
            file.write(b"\n")  # at the end: the loop read it all
        else:
            return
        file.flush()
        os.fsync(file.fileno())


def _kept(line: bytes, step: int) -> bool:
    """A row (a JSON object with a numeric ``step``) of a step ≤ ``step``."""
    try:
        row = json.loads(line)
    except ValueError:  # a torn or garbled line (JSONDecodeError, UnicodeDecodeError)
        return False
    value = row.get("step") if isinstance(row, dict) else None
    return isinstance(value, int | float) and not isinstance(value, bool) and value <= step


def _copy_kept(file: BinaryIO, path: Path, step: int) -> None:
    """The kept lines of ``file`` (``path``), as written, renamed over it."""
    rewrite_kept(file, path, ".truncating", lambda line: _kept(line, step))


def rewrite_kept(file: BinaryIO, path: Path, suffix: str, keep: Callable[[bytes], bool]
                 ) -> None:
    """The lines of ``file`` (open on ``path``) that ``keep``, each ending in a newline,
    into a fresh sibling ``path + suffix`` (made O_EXCL, never through a link), fsynced and
    renamed over ``path``: a crash leaves the old file or the new one, whole."""
    staging = path.with_name(path.name + suffix)
    staging.unlink(missing_ok=True)  # a crash's leftover, or a planted link: removed
    file.seek(0)
    with os.fdopen(create_owned(staging, 0o644), "wb") as out:
        for line in file:
            if keep(line):
                out.write(line if line.endswith(b"\n") else line + b"\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(staging, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)
