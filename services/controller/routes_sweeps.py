"""``/api/sweeps``: one config and a list of aggregation modes (or of override sets) ->
one job each, grouped, compared side by side on the dashboard's sweep page."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.responses import JSONResponse

from rollout.problems import Problem
from services.controller.auth import require_token
from services.controller.problems import Unprocessable, unprocessable
from services.controller.ray_jobs import BackendUnavailable
from services.controller.routes_jobs import (
    AUTH,
    INVALID,
    new_id,
    new_job,
    write_config_file,
)
from services.controller.schemas import (
    Message,
    SweepList,
    SweepMetricsOut,
    SweepOut,
    SweepRun,
    SweepSubmit,
)
from services.controller.state import Controller, Ctl
from services.controller.submission import (
    ConfigTooLarge,
    SubmissionError,
    config_from_data,
    resolve,
    submitted_config,
)
from services.controller.sweeps import variants
from services.controller.tables import ACTIVE, Sweep
from services.controller.views import (
    CHART_METRICS,
    columns,
    group_status,
    job_out,
    point_budget,
    split_names,
)

router = APIRouter(prefix="/api/sweeps", tags=["sweeps"])
NOT_FOUND = {404: {"model": Message, "description": "no such sweep"}}


def sweep_out(ctl: Controller, sweep: Sweep) -> SweepOut:
    jobs = ctl.store.sweep_jobs(sweep.id)
    axis = json.loads(sweep.spec).get("axis", "modes")
    return SweepOut(id=sweep.id, name=sweep.name, created_at=sweep.created_at, axis=axis,
                    status=group_status([j.status for j in jobs]),
                    jobs=[job_out(j) for j in jobs])


def sweep_or_404(ctl: Controller, sweep_id: str) -> Sweep:
    sweep = ctl.store.get_sweep(sweep_id)
    if sweep is None:
        raise HTTPException(404, f"no sweep {sweep_id}")
    return sweep


@router.post("", status_code=201, response_model=SweepOut,
             responses={**AUTH, **INVALID, 413: {"model": Message}},
             dependencies=[Depends(require_token)])
def submit_sweep(payload: SweepSubmit, ctl: Ctl) -> SweepOut | JSONResponse:
    """Validate every job of the sweep first; store and queue them only if all are valid."""
    try:  # parsed once; every run is validated from the same data
        data, stored_text = submitted_config(payload.config, payload.config_yaml)
        base = config_from_data(data, payload.overrides)
    except ConfigTooLarge as err:
        raise HTTPException(413, err.detail) from None
    except SubmissionError as err:
        return unprocessable(err.problems, err.detail)
    sweep_id, resolved, taken = new_id(), [], ctl.store.output_dirs()
    for label, extra in variants(base, payload.modes, payload.override_sets):
        job_id = new_id()
        try:
            resolved.append((label, job_id, resolve(
                data, [*payload.overrides, *extra], ctl.settings, job_id, stored_text,
                output_suffix=job_id, taken=taken)))
        except SubmissionError as err:
            return unprocessable(err.problems, err.detail, f"sweep run {label!r}: ")
    spec = {"axis": "modes" if payload.modes else "override_sets", "config": stored_text,
            "overrides": payload.overrides, "modes": payload.modes,
            "override_sets": payload.override_sets}
    sweep = Sweep(id=sweep_id, name=payload.name or base.name, spec=json.dumps(spec),
                  created_at=time.time())
    jobs = [new_job(r, job_id, sweep_id=sweep_id, sweep_label=label)
            for label, job_id, r in resolved]
    ctl.store.add_jobs(jobs, sweep)
    for _, job_id, r in resolved:
        try:
            write_config_file(r)
        except OSError as err:
            ctl.store.transition(job_id, "failed", error=f"cannot write the job folder: {err}")
    if ctl.reconciler is not None:
        ctl.reconciler.poke()
    return sweep_out(ctl, sweep)


@router.get("", response_model=SweepList)
def list_sweeps(ctl: Ctl, limit: Annotated[int, Query(ge=1, le=500)] = 50,
                offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> SweepList:
    """Sweeps, newest first."""
    sweeps, total = ctl.store.list_sweeps(limit, offset)
    return SweepList(items=[sweep_out(ctl, s) for s in sweeps], total=total)


@router.get("/{sweep_id}", response_model=SweepOut, responses=NOT_FOUND)
def get_sweep(sweep_id: str, ctl: Ctl) -> SweepOut:
    """A sweep and its jobs (each labelled by its mode or its overrides)."""
    return sweep_out(ctl, sweep_or_404(ctl, sweep_id))


def parse_after(after: Sequence[str]) -> dict[str, int]:
    """``?after=<job id>:<step>`` (repeatable) -> {job id: last step the page holds}."""
    seen: dict[str, int] = {}
    for item in after:
        job_id, _, step = item.rpartition(":")
        if not job_id or not step.lstrip("-").isdigit():
            raise Unprocessable([Problem("after", f"{item[:80]!r} is not <job id>:<step>")])
        seen[job_id] = int(step)
    return seen


@router.get("/{sweep_id}/metrics", response_model=SweepMetricsOut, responses=NOT_FOUND)
def sweep_metrics(sweep_id: str, ctl: Ctl,
                  names: Annotated[list[str] | None, Query(max_length=200)] = None,
                  max_points: Annotated[int, Query(ge=1, le=100_000)] = 2000,
                  after: Annotated[list[str] | None, Query(max_length=500)] = None
                  ) -> SweepMetricsOut:
    """Every run's metrics (default: the dashboard's charted ones), to overlay per metric.
    ``after=<job id>:<step>`` asks only for that run's steps after ``step``: the sweep page
    fetches increments, never every run's whole history again."""
    sweep_or_404(ctl, sweep_id)
    wanted = split_names(names) or list(CHART_METRICS)
    since = parse_after(after or [])
    runs, seen = [], set()
    jobs = ctl.store.sweep_jobs(sweep_id)
    budget = point_budget(wanted, max_points, readers=len(jobs))
    for job in jobs:
        rows, _ = ctl.store.sample_metrics(job.id, budget, since.get(job.id, -1) + 1)
        all_names, steps, series = columns(rows, wanted)
        seen.update(all_names)
        runs.append(SweepRun(job_id=job.id, label=job.sweep_label or job.name, mode=job.mode,
                             status=job.status, steps=steps, series=series))
    return SweepMetricsOut(sweep_id=sweep_id, names=sorted(seen), runs=runs)


@router.post("/{sweep_id}/cancel", response_model=SweepOut,
             responses={**NOT_FOUND, **AUTH, 503: {"model": Message}},
             dependencies=[Depends(require_token)])
def cancel_sweep(sweep_id: str, ctl: Ctl) -> SweepOut:
    """Cancel every job of the sweep that has not ended."""
    sweep = sweep_or_404(ctl, sweep_id)
    for job in ctl.store.sweep_jobs(sweep_id):
        if job.status not in ("queued", *ACTIVE):
            continue
        if job.ray_submission_id:
            try:
                ctl.backend.stop(job.ray_submission_id)
            except BackendUnavailable as err:
                raise HTTPException(503, f"cannot reach Ray: {err}") from None
        ctl.store.transition(job.id, "cancelled", error="cancelled by the user")
    return sweep_out(ctl, sweep)
