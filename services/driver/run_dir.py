"""A job folder and every file name in it, spelled once here.

    <job>/config.json         the resolved job config (JobConfig, every default filled)
    <job>/metrics.jsonl       one row per rollout step (the source of truth)
    <job>/updates.jsonl       one row per optimizer step, tagged with its rollout step
    <job>/eval.jsonl          one row per evaluated weight version (its ``step``)
    <job>/samples.jsonl       samples as text: logging.samples_per_step of each rollout
                              step (whole groups drawn at random), every evaluation
                              sample (``"eval": true``); appended, thinned past
                              logging.samples_max_mb (services/driver/samples.py)
    <job>/events.jsonl        placement, waiting, warnings, failures, restarts; a job
                              that fails for good ends with one ``failed`` event
                              (its one-line reason and exit code): what the controller
                              and the CLI say, never a line scraped from a log
    <job>/job_config.yaml     the config as submitted, when the controller started it
    <job>/driver.log          the driver's output as an older controller saved it: read
                              (never written) as a last resort; the controller now keeps
                              a finished job's output in <data>/logs/<id>.log, outside
                              the job folder (services/controller/job_files.py)
    <job>/tensorboard/        TensorBoard event files
    <job>/wandb/              W&B run files (offline runs sync from here)
    <job>/checkpoints/step_N  trainer state + driver state after rollout step N, N in 8
                              digits: step_00000003 (services/driver/checkpoint.py)
    <job>/checkpoints/latest  a link to the newest committed checkpoint
    <job>/checkpoints/set-aside-<time>/  checkpoints after the one a resume named, or
                              all of them for --no-resume: kept, never resumed from
    <job>/final_model/        the last checkpoint's weights as a Hugging Face folder
                              (trainer/export.py), written when the job ends; under
                              trainer.lora the adapters merged into the base
    <job>/final_adapter/      under trainer.lora: the last checkpoint's adapters as
                              peft's adapter folder
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from rollout.confined import Escapes, create_owned

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
UPDATES_FILE = "updates.jsonl"
"""Trainer metrics of every optimizer step, tagged with their rollout step, update and
epoch (its ``step`` field counts optimizer steps: docs/glossary.md)."""
EVAL_FILE = "eval.jsonl"
SAMPLES_FILE = "samples.jsonl"
"""Samples as text: some of every rollout's and every evaluation's, bounded by
logging.samples_max_mb (services/driver/samples.py)."""
EVENTS_FILE = "events.jsonl"
JOB_CONFIG_FILE = "job_config.yaml"
"""The config as the controller received it (before defaults), when it submitted the job."""
LOG_FILE = "driver.log"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
CHECKPOINTS_DIR = "checkpoints"
FINAL_MODEL_DIR = "final_model"
FINAL_ADAPTER_DIR = "final_adapter"
LATEST_LINK = "latest"
"""In checkpoints/: a relative symbolic link to the newest committed checkpoint."""
SET_ASIDE_PREFIX = "set-aside-"
FAILED_EVENT = "failed"
"""The kind of the event a driver writes once, when its job fails for good."""
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
"""A terminal escape (colours, cursor moves): a job's events and a cause read from its
log are plain text (Ray colours the messages it relays)."""


def data_dir() -> Path:
    """Tally's own folder: built models, warm starts, default job folders."""
    return Path(os.environ.get("TALLY_DATA_DIR", Path.home() / ".tally"))


def job_dir(name: str, configured: str | None = None) -> Path:
    """``output_dir`` when the config names one, else <data dir>/jobs/<name>-<UTC time>."""
    if configured:
        return Path(configured)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return data_dir() / "jobs" / f"{name}-{stamp}"


@dataclass(frozen=True)
class RunDir:
    """One job's folder."""

    path: Path

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def updates_file(self) -> Path:
        return self.path / UPDATES_FILE

    @property
    def eval_file(self) -> Path:
        return self.path / EVAL_FILE

    @property
    def samples_file(self) -> Path:
        return self.path / SAMPLES_FILE

    @property
    def events_file(self) -> Path:
        return self.path / EVENTS_FILE

    @property
    def log_file(self) -> Path:
        return self.path / LOG_FILE

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / TENSORBOARD_DIR

    @property
    def wandb_dir(self) -> Path:
        return self.path / WANDB_DIR

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def final_model_dir(self) -> Path:
        return self.path / FINAL_MODEL_DIR

    @property
    def final_adapter_dir(self) -> Path:
        return self.path / FINAL_ADAPTER_DIR

    @property
    def latest_link(self) -> Path:
        return self.checkpoints_dir / LATEST_LINK

    def set_aside_dir(self) -> Path:
        """A new folder in checkpoints/ for checkpoints no resume may use."""
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")
        return self.checkpoints_dir / f"{SET_ASIDE_PREFIX}{stamp}"

    def describe(self) -> list[str]:
        """What the job folder holds, one line each, for the end of a job."""
        lines = [f"output: {self.path}"]
        for name, what in ((METRICS_FILE, "one per rollout step"),
                           (UPDATES_FILE, "one per optimizer step"),
                           (EVAL_FILE, "one per evaluated weight version")):
            if (self.path / name).is_file():
                with (self.path / name).open("rb") as rows:
                    count = sum(1 for _ in rows)
                if count:
                    lines.append(f"  {name:<20} {count} rows ({what})")
        if self.final_model_dir.is_dir():
            lines.append(f"  {FINAL_MODEL_DIR + '/':<20} the last checkpoint's weights as a "
                         "Hugging Face folder")
        if self.final_adapter_dir.is_dir():
            lines.append(f"  {FINAL_ADAPTER_DIR + '/':<20} the last checkpoint's LoRA adapters "
                         "(peft's folder)")
        if self.latest_link.is_symlink():
            lines.append(f"  {CHECKPOINTS_DIR}/{LATEST_LINK} → "
                         f"{os.readlink(self.latest_link)}")
        if self.tensorboard_dir.is_dir():
            lines.append(f"  {TENSORBOARD_DIR + '/':<20} tensorboard --logdir "
                         f"{self.tensorboard_dir}")
        if self.wandb_dir.is_dir():
            lines.append(f"  {WANDB_DIR + '/':<20} W&B run files")
        return lines

    def create(self) -> RunDir:
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def write_event(self, kind: str, message: str, **fields: Any) -> None:
        """One job event (placement, failures, restarts) for the log and the controller;
        ``fields``: what an event of ``kind`` adds (:func:`write_event`)."""
        write_event(self.path, kind, message, **fields)


def open_append(path: Path) -> TextIO:
    """``path`` opened to append (made 0644 when missing), never through a link.

    The job folder is the driver's own, but on a shared volume anyone of the same uid may
    plant a link in it (``events.jsonl -> ~/.bashrc``): the file itself is opened with
    O_APPEND|O_CREAT|O_NOFOLLOW, and refused (Escapes, naming it) when it is a link or not
    a regular file (a FIFO is opened non-blocking, then refused)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        descriptor = os.open(path, flags, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise Escapes(f"{path}: is a symbolic link; a job file is never written "
                          "through a link") from None
        if err.errno == errno.ENXIO:  # a FIFO nobody reads
            raise Escapes(f"{path}: not a regular file; refused") from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise Escapes(f"{path}: not a regular file; refused")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "a", encoding="utf-8")


def replace_file(path: Path, text: str) -> None:
    """Write ``path`` whole: a new sibling file (O_EXCL|O_NOFOLLOW, a fresh name) renamed
    over it, so a link planted at ``path`` is replaced, never written through."""
    staged = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with os.fdopen(create_owned(staged, 0o644), "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(staged, path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def write_event(job_dir: Path, kind: str, message: str, **fields: Any) -> None:
    """Append one event to ``<job_dir>/events.jsonl``: the one writer of that file (never
    through a link: :func:`open_append`). ``fields``: what an event of ``kind`` adds
    (``exit_code`` of a ``failed`` one)."""
    with open_append(job_dir / EVENTS_FILE) as events:
        events.write(event_line(kind, message, **fields))


def event_line(kind: str, message: str, **fields: Any) -> str:
    """One line of events.jsonl (what :func:`write_event` appends; the controller writes
    its ``waiting`` events in the same format)."""
    record = {"time": time.time(), "kind": kind, "message": ANSI.sub("", message), **fields}
    return json.dumps(record) + "\n"


@dataclass(frozen=True)
class Failure:
    """Why a job failed for good, as its driver said it (the ``failed`` event)."""

    message: str
    """One line: the reason a user reads first."""
    exit_code: int | None
    time: float


def write_failure(job_dir: Path, reason: str, exit_code: int) -> None:
    """The ``failed`` event, the reason on one line (a message's lines joined by "; ").
    Never raises: a folder that is gone (or a link planted at events.jsonl) loses only
    the event, and the error being reported stays the one raised."""
    line = "; ".join(part.strip() for part in ANSI.sub("", reason).splitlines()
                     if part.strip())
    if job_dir.is_dir():
        with contextlib.suppress(OSError, Escapes):
            write_event(job_dir, FAILED_EVENT, line, exit_code=exit_code)


def last_failure(events: list[dict[str, Any]], since: float = 0.0) -> Failure | None:
    """The last ``failed`` event of ``events`` (events.jsonl's records, in order) written
    at or after ``since`` (a job folder used again keeps an earlier run's failure); None
    when the job died without writing one (killed, its node lost)."""
    for event in reversed(events):
        written = event.get("time")
        written = float(written) if isinstance(written, int | float) else 0.0
        if event.get("kind") == FAILED_EVENT and written >= since:
            code = event.get("exit_code")
            return Failure(str(event.get("message", "")),
                           code if isinstance(code, int) else None, written)
    return None


def read_events(text: str) -> list[dict[str, Any]]:
    """events.jsonl's records (torn or foreign lines skipped)."""
    events = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            if isinstance(record := json.loads(line), dict):
                events.append(record)
    return events
