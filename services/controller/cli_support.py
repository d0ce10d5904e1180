"""What the controller commands of ``tally`` share: an HTTP client, table printing, and
a failed job's cause (the driver's ``failed`` event first)."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import typer

from services.driver.run_dir import ANSI, last_failure

DEFAULT_URL = "http://127.0.0.1:8000"
WHOLE_INPUT = ("<config>", "<body>")
"""The ``field`` of a 422 problem with the whole config or request (said without it)."""


def base_url(url: str | None) -> str:
    return (url or os.environ.get("TALLY_CONTROLLER_URL") or DEFAULT_URL).rstrip("/")


@contextmanager
def client(url: str | None, timeout: float | None = 30.0) -> Iterator[httpx.Client]:
    """A client of the controller (token from TALLY_API_TOKEN); exits 1 when unreachable."""
    token = os.environ.get("TALLY_API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = base_url(url)
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=timeout) as http:
            yield http
    except httpx.TransportError as err:
        typer.echo(f"cannot reach the controller at {base}: {err} (is `tally serve` "
                   "running? set --url or TALLY_CONTROLLER_URL)", err=True)
        raise typer.Exit(1) from None


def checked(response: httpx.Response) -> Any:
    """The JSON of a 2xx answer; otherwise print the error (fields named) and exit."""
    if response.is_success:
        return response.json()
    try:
        body = response.json()
    except ValueError:
        body = {"detail": response.text}
    errors = body.get("errors") or []
    if len(errors) == 1:  # one line: the field (none for the whole config) and what to fix
        field, message = errors[0]["field"], errors[0]["message"]
        named = "" if field in WHOLE_INPUT else f"{field}: "
        typer.echo(f"error {response.status_code}: {named}{message}", err=True)
    else:
        lines = [f"  {e['field']}: {e['message']}" for e in errors]
        detail = body.get("detail") if not lines else "invalid request:"
        typer.echo("\n".join([f"error {response.status_code}: {detail}", *lines]), err=True)
    raise typer.Exit(2 if response.status_code == 422 else 1)


EXCEPTION_PREFIX = re.compile(r"^(error: |[A-Za-z_][\w.]*\.(?=[A-Z]\w*(Error|Failed): ))")
"""What comes before the cause on a log's last line: ``error: `` or a module path."""


def failure_reason(job: dict[str, Any]) -> str:
    """A failed job's cause on one line, as its driver said it: its ``failed`` event (the
    job's ``events``, services/driver/run_dir.py). Only for a job that died without one
    (killed, its node lost), its last log line (a Tally driver's says why), else the last
    line of its error."""
    failure = last_failure(job.get("events") or [], since=job.get("created_at") or 0.0)
    if failure is not None and failure.message:
        return failure.message
    for text in (job.get("log_tail"), job.get("error")):
        lines = [ANSI.sub("", line).strip() for line in (text or "").splitlines()]
        if lines := [line for line in lines if line]:
            return EXCEPTION_PREFIX.sub("", lines[-1])
    return "no error was recorded"


def when(timestamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) if timestamp else "-"


def print_jobs(jobs: list[dict[str, Any]]) -> None:
    typer.echo(f"{'ID':<13} {'NAME':<26} {'STATUS':<10} {'MODE':<12} {'STEP':>9} "
               f"{'REWARD':>7}  STARTED")
    for job in jobs:
        step = f"{(job['last_step'] + 1) if job['last_step'] is not None else 0}/{job['num_steps']}"
        reward = f"{job['reward_mean']:.3f}" if job["reward_mean"] is not None else "-"
        typer.echo(f"{job['id']:<13} {job['name'][:26]:<26} {job['status']:<10} "
                   f"{job['mode']:<12} {step:>9} {reward:>7}  {when(job['started_at'])}")


def print_job(job: dict[str, Any], url: str) -> None:
    for key in ("id", "name", "status", "mode", "source", "sweep_id", "ray_submission_id",
                "output_dir"):
        if job.get(key) is not None:
            typer.echo(f"{key + ':':<19} {job[key]}")
    step = job["last_step"] + 1 if job["last_step"] is not None else 0
    typer.echo(f"{'steps:':<19} {step}/{job['num_steps']}")
    if job["reward_mean"] is not None:
        typer.echo(f"{'reward/mean:':<19} {job['reward_mean']:.4f}")
    for key in ("created_at", "started_at", "finished_at"):
        typer.echo(f"{key + ':':<19} {when(job[key])}")
    typer.echo(f"{'dashboard:':<19} {url}/jobs/{job['id']}")
    last = (job.get("events") or [{}])[-1]
    if last.get("kind") == "waiting" and job["status"] in ("queued", "pending", "running"):
        typer.echo(f"{'waiting:':<19} {last['message'].removeprefix('waiting for ')}")
    cause = (job.get("error") or "").strip()
    if cause:
        typer.echo(f"{'error:':<19} {cause}")
    shown = [line for line in (job.get("log_tail") or "").splitlines()
             if not _says(ANSI.sub("", line).strip(), cause)]  # the cause once, above
    if any(line.strip() for line in shown):
        typer.echo("last log lines:\n" + "\n".join(f"  {line}" for line in shown))


def _says(line: str, cause: str) -> bool:
    """Is ``line`` the cause (or its first line, when its lines were joined with "; ")?"""
    return bool(line) and (cause == line or cause.startswith(line + "; "))


def stream_logs(url: str | None, job_id: str, follow: bool, tail: int | None) -> None:
    params: dict[str, Any] = {"follow": follow}
    if tail:
        params["tail"] = tail
    with client(url, timeout=None) as http, http.stream(
            "GET", f"/api/jobs/{job_id}/logs", params=params) as response:
        if not response.is_success:
            response.read()
            checked(response)
        for chunk in response.iter_text():
            sys.stdout.write(chunk)
            sys.stdout.flush()
