"""Reading a job's samples.jsonl (services/driver/samples.py writes it) for
``GET /api/jobs/{id}/samples`` and ``tally samples``: which steps have samples, and the
rows of one step, without parsing the whole file on every read.

A :class:`SampleIndex` holds each complete line's byte offset, step and whether it is an
evaluation sample. A refresh reads only what was appended since the last one (the driver
appends whole lines); a torn last line waits for its end; a file that was replaced (a
resume truncates it: services/driver/sinks.truncate_after), shrank, or no longer ends its
indexed part with the bytes it did is indexed again from the start. A line that is not a
JSON object with an integer ``step`` is skipped, as ``read_samples`` skips it. A training
sample's per-token record (its ``tokens``) is sent only when asked: the dashboard's table
reads without it, a sample opened with it.
"""

from __future__ import annotations

import json
import os
import threading
from array import array
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from rollout.confined import Escapes, open_inside
from services.controller.job_files import inside_root
from services.controller.schemas import SampleOut, SamplesOut, SampleTokensOut
from services.controller.settings import Settings
from services.driver.run_dir import SAMPLES_FILE

DEFAULT_LIMIT = 200
MAX_LIMIT = 1000
"""Samples one read returns at most."""
MAX_LINE_BYTES = 4 << 20
"""A longer line is skipped, never parsed."""
EDGE_BYTES = 256
"""The last bytes of the indexed part, compared on each refresh: a file rewritten in place
to at least its old size does not keep them."""


class SampleIndex:
    """Where each sample of one samples.jsonl is; thread-safe."""

    def __init__(self, path: Path, root: Path | None = None) -> None:
        """``path`` is read by the confinement rule from ``root`` (a job folder's allowed
        root: no component below it may be a link), or from its own folder."""
        self.path = path
        self.root = root if root is not None else path.parent
        self.relative = PurePosixPath(path.relative_to(self.root).as_posix())
        self._lock = threading.Lock()
        self._reset(None)

    def _open(self) -> BinaryIO:
        """The file, never through a link (Escapes naming samples.jsonl for one)."""
        return os.fdopen(open_inside(self.root, self.relative, SAMPLES_FILE), "rb")

    def _reset(self, identity: tuple[int, int] | None) -> None:
        self.identity = identity
        self.size = 0
        """Bytes indexed: up to the end of the last complete line."""
        self.edge = b""
        """The file's last EDGE_BYTES bytes before ``size``."""
        self.offsets = array("q")
        self.steps = array("q")
        self.evals = array("b")

    def refresh(self) -> bool:
        """Index what was appended; False when there is no file."""
        with self._lock:
            try:
                file = self._open()
            except Escapes:
                self._reset(None)
                raise
            except OSError:
                self._reset(None)
                return False
            with file:
                stat = os.fstat(file.fileno())
                identity = (stat.st_dev, stat.st_ino)
                if (identity != self.identity or stat.st_size < self.size
                        or _edge_at(file, self.size) != self.edge):
                    self._reset(identity)
                if stat.st_size > self.size:
                    self._index_from(file, self.size, stat.st_size)
                    self.edge = _edge_at(file, self.size)
            return True

    def _index_from(self, file: BinaryIO, start: int, end: int) -> None:
        file.seek(start)
        position = start
        while position < end:
            line = file.readline(MAX_LINE_BYTES + 1)
            if not line.endswith(b"\n"):
                if len(line) <= MAX_LINE_BYTES:
                    return  # torn: the writer has not finished it
                while line and not line.endswith(b"\n"):  # too long: skipped whole
                    position += len(line)
                    line = file.readline(MAX_LINE_BYTES)
                position += len(line)
                self.size = position
                continue
            row = _parse(line)
            if row is not None:
                self.offsets.append(position)
                self.steps.append(row["step"])
                self.evals.append(bool(row.get("eval")))
            position += len(line)
            self.size = position

    def step_lists(self) -> tuple[list[int], list[int]]:
        """(rollout steps with training samples, weight versions with evaluation
        samples), each ascending."""
        with self._lock:
            pairs = set(zip(self.steps, self.evals, strict=True))
        return (sorted(s for s, e in pairs if not e), sorted(s for s, e in pairs if e))

    def select(self, step: int | None, evaluation: bool | None, limit: int,
               index: int | None = None) -> tuple[list[dict[str, Any]], int]:
        """(the rows of ``step`` (all steps: None) that are evaluation samples or training
        ones (``evaluation``; both: None), and with ``index`` only the training samples of
        that row of their batch, at most ``limit``: a step's first, else the newest; how
        many matched). Rows in file order. ``index`` is not indexed: the step's lines are
        read to find it."""
        with self._lock:
            found = [offset for offset, s, e in zip(self.offsets, self.steps, self.evals,
                                                      strict=True)
                     if (step is None or s == step)
                     and (evaluation is None or bool(e) == evaluation)
                     and (index is None or not e)]
        rows = []
        with self._open() as file:
            if index is not None:  # parsed to be matched, then bounded
                found = [(offset, row) for offset, row in
                         ((offset, _read_at(file, offset)) for offset in found)
                         if row is not None and row.get("index") == index]
            chosen = found[:limit] if step is not None else found[max(0, len(found) - limit):]
            for entry in chosen:
                row = entry[1] if index is not None else _read_at(file, entry)
                if row is not None:  # None: the file changed under the read
                    rows.append(row)
        return rows, len(found)


def _read_at(file: BinaryIO, offset: int) -> dict[str, Any] | None:
    file.seek(offset)
    return _parse(file.readline(MAX_LINE_BYTES + 1))


def _edge_at(file: BinaryIO, size: int) -> bytes:
    start = max(0, size - EDGE_BYTES)
    file.seek(start)
    return file.read(size - start)


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or type(row.get("step")) is not int:
        return None
    return row


class SampleIndexes:
    """The indexes of the files read lately (at most ``size``), by path."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._indexes: OrderedDict[Path, SampleIndex] = OrderedDict()

    def of(self, settings: Settings, job_dir: str | None) -> SampleIndex | None:
        """The index of ``<job_dir>/samples.jsonl``, read from the allowed root the folder
        lies in; None for a folder outside every root (never read)."""
        where = inside_root(settings, job_dir)
        if where is None:
            return None
        path = where[0] / where[1] / SAMPLES_FILE
        with self._lock:
            index = self._indexes.pop(path, None) or SampleIndex(path, where[0])
            self._indexes[path] = index
            while len(self._indexes) > self.size:
                self._indexes.popitem(last=False)
        return index


NO_FILE = "no samples yet: the job writes samples.jsonl from its first rollout step"
OUTSIDE = "the job folder is outside the allowed roots (TALLY_ALLOWED_ROOTS)"


def samples_out(job_id: str, index: SampleIndex | None, step: int | None,
                evaluation: bool | None, limit: int = DEFAULT_LIMIT, *,
                tokens: bool = True, batch_index: int | None = None) -> SamplesOut:
    """A read of ``index`` (None: a folder not to read) as the API answers it; a row
    that is not a sample (SampleOut) is left out, a per-token record that does not hold
    (SampleTokensOut: one entry per token in each list) is left out of its sample.
    ``tokens``: send each sample's per-token record (else only ``has_tokens``);
    ``batch_index``: only the training samples of that row of their batch (``index``)."""
    if index is None or not index.refresh():
        return SamplesOut(job_id=job_id, steps=[], eval_steps=[], total=0, samples=[],
                          note=OUTSIDE if index is None else NO_FILE)
    rows, total = index.select(step, evaluation, limit, batch_index)
    samples = [sample for sample in (_sample(row, tokens) for row in rows) if sample]
    steps, eval_steps = index.step_lists()
    return SamplesOut(job_id=job_id, steps=steps, eval_steps=eval_steps, total=total,
                      samples=samples, note=None)


def _sample(row: dict[str, Any], tokens: bool) -> SampleOut | None:
    """``row`` as a SampleOut (None: not a sample); its per-token record when ``tokens``
    and it holds, ``has_tokens`` set for a sample that has one that holds."""
    from pydantic import ValidationError

    recorded = row.get("tokens")
    try:
        per_token = (SampleTokensOut.model_validate(recorded)
                     if isinstance(recorded, dict) else None)
    except ValidationError:
        per_token = None  # a record that does not hold: the sample without it
    try:
        sample = SampleOut.model_validate({k: v for k, v in row.items()
                                           if k not in ("tokens", "has_tokens")})
    except ValidationError:
        return None
    if per_token is not None:
        sample.has_tokens = True  # assigned: set, so sent (exclude_unset)
        if tokens:
            sample.tokens = per_token
    return sample
