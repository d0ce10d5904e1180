"""The one error mapping (services/runtime/exit_codes.py) every ``tally`` command and
``python -m services.train`` answer through: a refused input is exit 2 with its line, a
failed run exit 1, anything else a traceback; through the real commands, nothing
started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from services.cli import app
from services.cli.common import mapped
from services.config.errors import ConfigError
from services.driver.loop import JobFailed
from services.runtime.exit_codes import FAILED, REFUSED, Failed, Refused, exit_for
from trainer.export_base import ExportError

ROOT = Path(__file__).resolve().parents[3]


def test_each_known_error_has_its_code_and_line() -> None:
    config_error = ConfigError("job.yaml", [])
    assert exit_for(config_error) == (REFUSED, str(config_error))
    assert exit_for(ExportError("step_3: no such checkpoint")) == (
        REFUSED, "error: step_3: no such checkpoint")
    assert exit_for(JobFailed("rank 1 died")) == (FAILED, "error: rank 1 died")
    assert exit_for(Refused("error: --layouts: bad")) == (REFUSED, "error: --layouts: bad")
    assert exit_for(Failed("2 rows off")) == (FAILED, "2 rows off")
    assert exit_for(ValueError("a bug")) is None  # not mapped: its traceback shows


def test_a_mapped_command_exits_with_its_code_and_its_line_on_stderr() -> None:
    """A returned code is the exit code; a known error is its line and code; an unknown
    error is not swallowed."""
    def run(code: int = 0, error: str = "") -> int:
        if error == "refused":
            raise Refused("error: nothing started")
        if error == "bug":
            raise KeyError("bug")
        return code

    demo = typer.Typer()
    demo.command()(mapped(run))  # as services/cli/__init__.py registers every command
    runner = CliRunner()
    assert runner.invoke(demo, ["--code", "0"]).exit_code == 0
    assert runner.invoke(demo, ["--code", "1"]).exit_code == 1
    refused = runner.invoke(demo, ["--error", "refused"])
    assert (refused.exit_code, refused.stderr) == (2, "error: nothing started\n")
    bug = runner.invoke(demo, ["--error", "bug"])
    assert bug.exit_code == 1 and isinstance(bug.exception, KeyError)


def test_commands_refuse_through_the_mapping_before_anything_starts(tmp_path: Path) -> None:
    """A config that does not load, a checkpoint folder with none, a layout that does not
    parse: exit 2 and one line each, from the real commands."""
    runner = CliRunner()
    missing = runner.invoke(app, ["validate", str(tmp_path / "none.yaml")])
    assert missing.exit_code == 2 and "none.yaml" in missing.stderr
    empty = runner.invoke(app, ["checkpoint", "verify", str(tmp_path)])
    assert empty.exit_code == 2
    assert empty.stderr.startswith(f"error: {tmp_path.resolve()}: no checkpoint here")
    layouts = runner.invoke(app, ["verify-aggregation", str(ROOT / "configs" / "demo.yaml"),
                                  "--layouts", "dp1cp1-ragged"])
    assert layouts.exit_code == 2, layouts.output
    assert layouts.stderr.startswith("error: layouts: expected entries like")


@pytest.mark.parametrize("entry", [["-m", "services.train"], ["-m", "services.cli", "train"]])
def test_both_entry_points_map_a_bad_config_to_2(entry: list[str], tmp_path: Path) -> None:
    """``python -m services.train`` and ``tally train`` answer a config that does not
    load alike: its line on stderr, exit 2."""
    result = subprocess.run([sys.executable, *entry, str(tmp_path / "none.yaml")],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "none.yaml" in result.stderr and "Traceback" not in result.stderr
