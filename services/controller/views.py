"""Store rows -> API models: jobs, column-oriented metrics with downsampling."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from fastapi import HTTPException

from services.controller.schemas import JobDetail, JobEvent, JobOut, JobStatus, MetricsOut
from services.controller.store import MetricTriple
from services.controller.tables import Job
from services.metrics import EVENTS_FILE

CHART_METRICS = (
    "pg_loss", "pg_loss/sample_mean", "pg_loss/token_mean", "pg_loss/prompt_mean",
    "pg_loss/constant", "reward/mean", "reward/std", "kl", "entropy", "clip_fraction",
    "clip_fraction/min", "clip_fraction/max", "grad_norm", "response_length/mean",
    "perf/tokens_per_s", "padding_fraction",
)
"""What the dashboard charts (the defaults of a sweep's metrics)."""


def job_out(job: Job) -> JobOut:
    return JobOut.model_validate(job, from_attributes=True)


def job_events(output_dir: str | None, roots: Sequence[Path], limit: int = 200
               ) -> list[JobEvent]:
    """The last events the driver wrote to <job folder>/events.jsonl (torn lines skipped);
    none from a folder outside the allowed ``roots``."""
    if not output_dir or not any(Path(output_dir).resolve().is_relative_to(root)
                                 for root in roots):
        return []
    try:  # a registered job's folder may be anything: unreadable means no events
        lines = (Path(output_dir) / EVENTS_FILE).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    events = []
    for line in lines[-limit:]:
        try:
            events.append(JobEvent.model_validate_json(line))
        except ValueError:
            continue
    return events


def job_detail(job: Job, roots: Sequence[Path]) -> JobDetail:
    base = job_out(job).model_dump()
    return JobDetail(**base, config_submitted=job.config_submitted,
                     overrides=json.loads(job.overrides or "[]"),
                     config_resolved=json.loads(job.config_resolved or "{}"),
                     log_tail=job.log_tail or None, events=job_events(job.output_dir, roots))


def pick_indices(count: int, max_points: int) -> list[int]:
    """At most ``max_points`` evenly spread indices of ``range(count)``, first and last kept."""
    if count <= max_points:
        return list(range(count))
    if max_points == 1:
        return [count - 1]
    return sorted({round(i * (count - 1) / (max_points - 1)) for i in range(max_points)})


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


def columns(rows: Sequence[MetricTriple], names: Sequence[str] | None, max_points: int,
            readers: int = 1, capped: bool = True
            ) -> tuple[list[str], list[int], dict[str, list[float | None]], bool]:
    """(all names, steps, series of the wanted names that exist, downsampled?); at most
    MAX_CELLS values over ``readers`` such answers (a sweep's runs) when ``capped``."""
    all_names = sorted({name for _, _, values in rows for name in values})
    known = set(all_names)
    wanted = [n for n in names if n in known] if names else all_names
    if capped:
        max_points = max(1, min(max_points, MAX_CELLS // max(1, len(wanted) * readers)))
    keep = [rows[i] for i in pick_indices(len(rows), max_points)]
    series = {name: [values.get(name) for _, _, values in keep] for name in wanted}
    return all_names, [step for step, _, _ in keep], series, len(keep) < len(rows)


def metrics_out(job_id: str, rows: Sequence[MetricTriple], names: Sequence[str] | None,
                max_points: int) -> MetricsOut:
    all_names, steps, series, downsampled = columns(rows, names, max_points)
    return MetricsOut(job_id=job_id, names=all_names, steps=steps, series=series,
                      total_points=len(rows), downsampled=downsampled)


def group_status(statuses: Sequence[str]) -> JobStatus:
    """The least finished status of a group of jobs."""
    for status in ("running", "pending", "queued", "failed", "cancelled"):
        if status in statuses:
            return status  # type: ignore[return-value]
    return "succeeded"
