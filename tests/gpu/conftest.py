"""The GPU run's one table: each check adds (what, figure, bound) through ``report``;
the table is printed at the end of the run and, where ``TALLY_GPU_TABLE`` names a file,
written there too (tests/gpu/run.sh puts it under $OUT on the GPU machine)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

ROWS: list[tuple[str, str, str, str]] = []


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[[str, str, str], None]:
    def add(check: str, figure: str, bound: str = "") -> None:
        ROWS.append((request.node.name, check, figure, bound))

    return add


def format_table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    width = max(len(check) for _, check, _, _ in rows)
    lines = [f"{'check':<{width}}  {'figure':>18}  bound", "-" * (width + 30)]
    lines += [f"{check:<{width}}  {figure:>18}  {bound}" for _, check, figure, bound in rows]
    return lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not ROWS:
        return
    lines = format_table(ROWS)
    terminalreporter.write_sep("=", "GPU figures")
    for line in lines:
        terminalreporter.write_line(line)
    if target := os.environ.get("TALLY_GPU_TABLE"):
        Path(target).write_text("\n".join(lines) + "\n")
