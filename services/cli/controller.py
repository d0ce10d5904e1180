"""The controller's commands (docs/controller.md): ``serve`` runs it; submit, jobs,
status, logs, samples and cancel are its clients (services/controller/cli_support.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from services.cli.common import ConfigArg, SetOpt, UrlOpt
from services.runtime.exit_codes import FAILED, Refused


def serve(host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
          port: Annotated[int, typer.Option(help="port to bind")] = 8000,
          log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info") -> None:
    """Run the controller: REST API, dashboard, job store; starts a local Ray head unless
    TALLY_RAY_ADDRESS names one. Data in TALLY_DATA_DIR (default ~/.tally). Prints
    "Tally controller ready at URL" once it can take work (GET /readyz)."""
    from services.controller.server import serve as run_server
    from services.controller.settings import Settings

    try:
        run_server(Settings.from_env(host=host, port=port), log_level)
    except ValueError as err:  # a setting refused (the environment, the data folder)
        raise Refused(str(err)) from None


def submit(
    config: ConfigArg, set_: SetOpt = None, url: UrlOpt = None,
    sweep_modes: Annotated[str | None, typer.Option(
        help="one job per mode, grouped in a sweep: sample_mean,token_mean,prompt_mean,constant")]
    = None,
    sweep_set: Annotated[list[str] | None, typer.Option(
        help="one job per value, grouped in a sweep: 'key=v;key2=v2' (repeatable)")] = None,
) -> None:
    """Submit a job (or a sweep) to the controller; prints the job or sweep id."""
    from services.controller.cli_support import base_url, checked, client

    text = config.read_text(encoding="utf-8")
    body = {"config_yaml": text, "overrides": set_ or []}
    with client(url) as http:
        if sweep_modes or sweep_set:
            body |= ({"modes": [m.strip() for m in sweep_modes.split(",") if m.strip()]}
                     if sweep_modes else
                     {"override_sets": [[o for o in s.split(";") if o] for s in sweep_set or []]})
            sweep = checked(http.post("/api/sweeps", json=body))
            for job in sweep["jobs"]:
                typer.echo(f"{job['id']}  {job['sweep_label']}")
            typer.echo(f"sweep {sweep['id']}: {base_url(url)}/sweeps/{sweep['id']}")
        else:
            job = checked(http.post("/api/jobs", json=body))
            typer.echo(f"job {job['id']} {job['status']}: {base_url(url)}/jobs/{job['id']}")


def jobs(url: UrlOpt = None,
         status: Annotated[list[str] | None, typer.Option(help="filter (repeatable)")] = None,
         limit: Annotated[int, typer.Option(help="at most this many")] = 20) -> None:
    """List jobs, newest first."""
    from services.controller.cli_support import checked, client, print_jobs

    with client(url) as http:
        page = checked(http.get("/api/jobs", params={"status": status or [], "limit": limit}))
    print_jobs(page["items"])


def status(job_id: str, url: UrlOpt = None,
           as_json: Annotated[bool, typer.Option("--json", help="the whole record")] = False
           ) -> int:
    """One job: status, steps, reward, and for a failure its last log lines and its cause
    (once; exit code 1)."""
    import json

    from services.controller.cli_support import (
        base_url,
        checked,
        client,
        failure_reason,
        print_job,
    )
    from services.driver.run_dir import ANSI

    with client(url) as http:
        job = checked(http.get(f"/api/jobs/{job_id}"))
    if as_json:
        typer.echo(json.dumps(job, indent=2))
    elif job["status"] != "failed":
        print_job(job, base_url(url))
    else:
        cause = failure_reason(job)  # the driver's failed event first, else its log
        print_job({**job, "error": None, "log_tail": None}, base_url(url))
        before = [line for line in (job.get("log_tail") or "").splitlines()
                  if line.strip() and cause not in ANSI.sub("", line)]
        if before:
            typer.echo("last log lines:\n" + "\n".join(f"  {line}" for line in before))
        typer.echo(f"error: {cause}")
    return FAILED if job["status"] == "failed" else 0


def logs(job_id: str, url: UrlOpt = None,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="stream until it ends")]
         = False,
         tail: Annotated[int | None, typer.Option(help="only the last N lines")] = None) -> None:
    """The job's driver output (from Ray, or saved in its folder)."""
    from services.controller.cli_support import stream_logs

    stream_logs(url, job_id, follow, tail)


def samples(job: Annotated[str, typer.Argument(
                help="a job folder, or the id of a job on the controller (--url)")],
            step: Annotated[int | None, typer.Option(
                help="a rollout step (with --eval: a weight version); default: the newest")]
            = None,
            evaluation: Annotated[bool, typer.Option(
                "--eval", help="evaluation samples instead of training ones")] = False,
            as_json: Annotated[bool, typer.Option(
                "--json", help="the records, one JSON object per line")] = False,
            full: Annotated[bool, typer.Option(
                "--full", help="whole prompts and responses, not shortened")] = False,
            limit: Annotated[int, typer.Option(min=1, max=1000, help="at most this many")]
            = 200,
            tokens: Annotated[bool, typer.Option(
                "--tokens", help="each training sample's response token by token: text, "
                "advantage, engine and trainer log-prob, their gap, entropy, observations")]
            = False,
            url: UrlOpt = None) -> None:
    """A job's samples as text (samples.jsonl): per sample its step, group, reward and each
    part, advantage, tokens, prompt and response (--tokens: token by token)."""
    from services.cli.samples import print_samples

    print_samples(job, step, evaluation, as_json, full, limit, url, tokens)


def cancel(job_id: str, url: UrlOpt = None) -> None:
    """Cancel a job: its Ray job (driver and actors) is stopped."""
    from services.controller.cli_support import checked, client

    with client(url) as http:
        job = checked(http.post(f"/api/jobs/{job_id}/cancel"))
    typer.echo(f"job {job['id']} {job['status']}")

