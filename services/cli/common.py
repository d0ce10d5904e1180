"""What every command group shares: the options spelled once, loading a job config, and
``mapped``, which puts every command behind the one error mapping
(services/runtime/exit_codes.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from services.runtime.exit_codes import exit_for

if TYPE_CHECKING:
    from services.config.job import JobConfig

ConfigArg = Annotated[Path, typer.Argument(help="YAML job config", exists=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="override a field: --set trainer.optimizer.lr=1e-5 (repeatable)")]
AddressOpt = Annotated[str | None, typer.Option(
    help="Ray cluster to join (e.g. 127.0.0.1:6379); default: RAY_ADDRESS, else a local "
         "head started and stopped by this command")]
UrlOpt = Annotated[str | None, typer.Option(
    "--url", help="controller URL [default: $TALLY_CONTROLLER_URL or http://127.0.0.1:8000]")]


def mapped(command: Callable[..., int | None]) -> Callable[..., None]:
    """``command`` behind the one mapping: an error it knows is its line on stderr and its
    exit code; a command's own nonzero return is the exit code."""
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            code = command(*args, **kwargs)
        except Exception as err:  # typer.Exit and any unknown error pass on unchanged
            found = exit_for(err)
            if found is None:
                raise
            code, line = found
            typer.echo(line, err=True)
            raise typer.Exit(code) from None
        if code:
            raise typer.Exit(code)
    return run


def load_job(config: Path, overrides: list[str] | None, check: bool = False) -> JobConfig:
    """The job config (``check``: and every check before anything starts, preflight's,
    each note printed); a ConfigError goes to the mapping (its lines, exit code 2)."""
    from services.config.job import load_job_config

    job = load_job_config(config, overrides or [])
    if check:
        from services.runtime.preflight import preflight

        for note in preflight(job, load_user_code=True):  # the user's own machine
            typer.echo(f"note: {note}")
    return job
