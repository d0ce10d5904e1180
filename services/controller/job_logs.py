"""The one-line cause of a failed job, and the log without the stack dumps a stopped
process writes.

The cause is the ``failed`` event the driver wrote (services/driver/run_dir.py) with its
exit code (``job demo: ... (exit code 1)``). Only a job that died without writing one (a
killed process, a lost node, a driver that never started) has its cause read out of its
log: the exception line of the log's last Python traceback (with the indented lines of a
message that has several), or, without a traceback, the driver's last line, never one of
Ray's own logging or of another process
(``(TrainerRank pid=…)``); without ANSI colours; followed by the driver's exit code from
Ray's message (``ValueError: boom (exit code 1)``). Only when the log has none is it
Ray's own message, without the copy of the log Ray appends to it.

A process stopped with SIGTERM (``tally cancel``: Ray stops the driver) may print the
failure-signal handler's dump of Ray's core worker, ``*** SIGTERM received at time=…``
and ``PC: @ 0x7f…`` frames, often twice (raw and through Ray's logger); those lines say
nothing but "it was stopped", so :func:`without_stop_dumps` puts that in one line.
"""

from __future__ import annotations

import re

from services.controller.job_files import Escapes, read_job_file
from services.controller.settings import Settings
from services.driver.run_dir import ANSI, EVENTS_FILE, Failure, last_failure, read_events

__all__ = ["ANSI", "StopDumps", "driver_failure", "failure_cause", "without_stop_dumps"]
OTHER_PROCESS = re.compile(
    r"^(\([\w.:-]+(?: [\w.=:,-]+)*\) "  # (TrainerRank pid=12, ip=…) an actor's line
    r"|\[\d{4}-\d\d-\d\d [^\]]*\] "  # [2026-01-01 10:00:00,000 E 1 1] Ray's C++ logging
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(DEBUG|INFO|WARNING|ERROR)\s+\S+:\d+ -- )")
"""A line the driver itself did not print."""
_PREFIX = r"^(?:\([^)]*\) )?(?:\[[^\]]*\] \S+:\d+: )?"
SIGTERM_HEADER = re.compile(_PREFIX + r"\*\*\* SIGTERM received at time=")
DUMP_FRAME = re.compile(_PREFIX + r"\s*(?:PC: )?@\s+0x[0-9a-fA-F]+")
STOPPED_LINE = "[tally: the driver was stopped (SIGTERM); its stack dump is left out]"
EXIT_CODE = re.compile(r"failed with exit code (-?\d+)")
"""The driver's exit code in Ray's message of a failed job."""
MAX_CAUSE = 2000
"""Characters of a cause kept (a message may quote a whole record)."""


class StopDumps:
    """A filter of a log read in pieces (a followed stream): each run of SIGTERM dumps
    (header and frames) becomes one line. Holds back a piece's unfinished last line until
    the next piece or :meth:`flush`."""

    def __init__(self) -> None:
        self.partial = ""
        self.in_dump = False
        self.said = False
        """The one line of the current run went out already."""

    def feed(self, text: str) -> str:
        lines = (self.partial + text).splitlines(keepends=True)
        self.partial = lines.pop() if lines and not lines[-1].endswith("\n") else ""
        return "".join(self._line(line) for line in lines)

    def flush(self) -> str:
        rest, self.partial = self.partial, ""
        return self._line(rest) if rest else ""

    def _line(self, line: str) -> str:
        if SIGTERM_HEADER.match(line):
            said, self.in_dump, self.said = self.said, True, True
            return "" if said else STOPPED_LINE + "\n"
        if self.in_dump and DUMP_FRAME.match(line):
            return ""
        self.in_dump = self.said = False
        return line


def without_stop_dumps(text: str) -> str:
    """``text`` with each run of SIGTERM dumps (header and frames) as one line."""
    if "SIGTERM received" not in text:
        return text
    dumps = StopDumps()
    return dumps.feed(text) + dumps.flush()


def _exception_line(lines: list[str]) -> int | None:
    """Index of the exception line closing the last traceback in ``lines``."""
    start = max((i for i, line in enumerate(lines)
                 if line.startswith("Traceback (most recent call last):")), default=None)
    if start is None:
        return None
    return next((i for i in range(start + 1, len(lines))
                 if lines[i].strip() and not lines[i][0].isspace()), None)


def driver_failure(settings: Settings, output_dir: str | None, since: float
                   ) -> Failure | None:
    """The ``failed`` event a job's driver wrote at or after ``since`` (the job's creation:
    its folder may hold an earlier run's), read as the controller reads a job folder
    (inside the allowed roots, never through a link); None when there is none."""
    try:
        data = read_job_file(settings, output_dir, EVENTS_FILE)
    except Escapes:
        return None
    text = data.decode("utf-8", errors="replace") if data else ""
    return last_failure(read_events(text), since=since)


def failure_cause(logs: str | None, ray_message: str | None = None,
                  failure: Failure | None = None) -> str:
    """The one line that says why a job failed (the module says which), with the driver's
    exit code when the driver's event or Ray gave one."""
    head = ANSI.sub("", (ray_message or "").split(", last available logs")[0].strip())
    code = EXIT_CODE.search(head)
    if failure is not None and failure.message:  # the driver said it: no log is read
        exit_code = failure.exit_code if failure.exit_code is not None else (
            code[1] if code else None)
        said = f" (exit code {exit_code})" if exit_code is not None else ""
        return failure.message[:MAX_CAUSE] + said
    cause = _cause_in(logs or "")
    if cause is None:
        return head[:MAX_CAUSE] or "failed (no log, and no message from Ray)"
    return cause[:MAX_CAUSE] + (f" (exit code {code[1]})" if code else "")


def _cause_in(logs: str) -> str | None:
    lines = [ANSI.sub("", line).rstrip() for line in without_stop_dumps(logs).splitlines()]
    raised = _exception_line(lines)
    if raised is not None:  # with the indented lines of a message that has several
        parts = [lines[raised]]
        for line in lines[raised + 1:]:
            if not line[:1].isspace() or OTHER_PROCESS.match(line):
                break
            parts.append(line.strip())
        return "; ".join(parts)
    own = [line for line in lines if line.strip() and line != STOPPED_LINE
           and not OTHER_PROCESS.match(line)]
    return own[-1].strip().removeprefix("error: ") if own else None  # the driver's last
