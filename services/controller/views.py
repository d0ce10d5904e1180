"""Store rows -> API models: jobs, column-oriented metrics with downsampling."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from fastapi import HTTPException

from services.controller.job_files import Escapes, read_job_file
from services.controller.job_logs import ANSI
from services.controller.schemas import JobDetail, JobEvent, JobOut, JobStatus, MetricsOut
from services.controller.settings import Settings
from services.controller.store import MetricTriple
from services.controller.tables import Run
from services.driver.run_dir import EVENTS_FILE
from trainer.config import AGGREGATION_MODES

CHART_METRICS = (
    "pg_loss", "pg_loss/sample_mean", "pg_loss/token_mean", "pg_loss/prompt_mean",
    "pg_loss/constant", "reward/mean", "reward/std", "kl", "entropy", "clip_fraction",
    "clip_fraction/min", "clip_fraction/max", "grad_norm", "response_length/mean",
    "perf/tokens_per_s", "padding_fraction",
    *(f"length_bias/{mode}/{bucket}" for bucket in ("long", "short")
      for mode in AGGREGATION_MODES),
    "eval/accuracy", "eval/pass@k", "eval/k",
    *(f"perf/peak_mem_gb/{phase}" for phase in ("train", "sync", "checkpoint")),
)
"""What the dashboard charts (the defaults of a sweep's metrics)."""


def job_out(job: Run) -> JobOut:
    return JobOut.model_validate(job, from_attributes=True)


def job_events(output_dir: str | None, settings: Settings, limit: int = 200
               ) -> list[JobEvent]:
    """The last events the driver wrote to <job folder>/events.jsonl (its last MiB read by
    the confinement rule; torn lines skipped, terminal colours of a copied Ray message left
    out); none from a folder outside the allowed roots. A linked events.jsonl is never
    read: one ``refused`` event says so, naming it."""
    try:
        data = read_job_file(settings, output_dir, EVENTS_FILE)
    except Escapes as err:
        return [JobEvent(time=time.time(), kind="refused",
                         message=f"{err}; the controller never reads through it")]
    if data is None:
        return []
    events = []
    for line in data.decode("utf-8", errors="replace").splitlines()[-limit:]:
        try:
            event = JobEvent.model_validate_json(line)
        except ValueError:
            continue
        events.append(event.model_copy(update={"message": ANSI.sub("", event.message)}))
    return events


def job_detail(job: Run, settings: Settings, private: bool = True) -> JobDetail:
    """One job; ``private`` False (a client off loopback without a token, auth.may_read):
    without what the job wrote (its events and last log lines)."""
    base = job_out(job).model_dump()
    return JobDetail(**base, config_submitted=job.config_submitted,
                     overrides=json.loads(job.overrides or "[]"),
                     config_resolved=json.loads(job.config_resolved or "{}"),
                     log_tail=(job.log_tail or None) if private else None,
                     events=job_events(job.output_dir, settings) if private else [])


MAX_NAMES = 200
"""Metric names one read may ask for."""
MAX_CELLS = 400_000
"""Points × series one read returns at most (max_points shrinks to fit)."""


def split_names(names: Sequence[str] | None) -> list[str]:
    """``?names=a,b&names=c`` -> [a, b, c] (each once); more than MAX_NAMES: 422."""
    split = list(dict.fromkeys(n for item in names or [] for n in item.split(",") if n))
    if len(split) > MAX_NAMES:
        raise HTTPException(422, f"names: at most {MAX_NAMES} metric names per request")
    return split


def point_budget(names: Sequence[str], max_points: int, readers: int = 1) -> int:
    """``max_points`` shrunk so that points × series × readers (a sweep's runs) stays
    within MAX_CELLS; no names asked means up to MAX_NAMES series."""
    series = len(names) or MAX_NAMES
    return max(1, min(max_points, MAX_CELLS // (series * readers)))


def columns(rows: Sequence[MetricTriple], names: Sequence[str]
            ) -> tuple[list[str], list[int], dict[str, list[float | None]]]:
    """(all names in the rows, steps, series of the wanted names that exist)."""
    all_names = sorted({name for _, _, values in rows for name in values})
    known = set(all_names)
    wanted = [n for n in names if n in known] if names else all_names
    series = {name: [values.get(name) for _, _, values in rows] for name in wanted}
    return all_names, [step for step, _, _ in rows], series


def metrics_out(job_id: str, rows: Sequence[MetricTriple], total: int,
                names: Sequence[str]) -> MetricsOut:
    all_names, steps, series = columns(rows, names)
    return MetricsOut(job_id=job_id, names=all_names, steps=steps, series=series,
                      total_points=total, downsampled=len(rows) < total)


def group_status(statuses: Sequence[str]) -> JobStatus:
    """The least finished status of a group of jobs."""
    for status in ("running", "pending", "queued", "failed", "cancelled"):
        if status in statuses:
            return status  # type: ignore[return-value]
    return "succeeded"
