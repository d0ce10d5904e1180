"""``/api/jobs``: submit (JSON or YAML), list, get, cancel, metrics in and out, register."""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Annotated

import yaml
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from rollout.problems import Problem
from services.config.job import JobConfig
from services.controller.auth import (
    Credentials,
    may_read,
    require_job_token,
    require_reader,
    require_token,
)
from services.controller.ending import contradicted_end, stop_in_ray
from services.controller.job_files import Escapes, refused, remove_job_folder
from services.controller.job_samples import DEFAULT_LIMIT, MAX_LIMIT, samples_out
from services.controller.problems import Unprocessable, request_problems, unprocessable
from services.controller.ray_jobs import BackendUnavailable
from services.controller.schemas import (
    IngestResult,
    JobDetail,
    JobList,
    JobRegister,
    JobStatus,
    JobSubmit,
    Message,
    MetricsIngest,
    MetricsOut,
    SamplesOut,
    StatusReport,
    ValidationErrorOut,
)
from services.controller.state import Controller, Ctl
from services.controller.store import clean_metrics
from services.controller.submission import (
    ConfigTooLarge,
    Resolved,
    SubmissionError,
    submitted_config,
)
from services.controller.submit_service import enqueue, resolve_submission
from services.controller.tables import TERMINAL, Run
from services.controller.views import job_detail, job_out, metrics_out, point_budget, split_names
from services.driver.run_dir import JOB_CONFIG_FILE

router = APIRouter(prefix="/api/jobs", tags=["jobs"])
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
NOT_FOUND = {404: {"model": Message, "description": "no such job"}}
AUTH = {401: {"model": Message, "description": "missing or wrong bearer token"}}
INVALID = {422: {"model": ValidationErrorOut, "description": "invalid request or config"}}
SUBMIT_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/JobSubmit"}},
    "application/yaml": {"schema": {"type": "string", "description": "the job config YAML; "
                                    "overrides go in ?set=key=value"}}}}}


def json_response(model: BaseModel, status_code: int = 200) -> Response:
    """Serialize once (FastAPI would validate a returned model again): the hot reads."""
    return Response(model.model_dump_json(), status_code, media_type="application/json")


def new_id() -> str:
    return secrets.token_hex(6)


def new_job(resolved: Resolved, job_id: str, **fields: object) -> Run:
    now = time.time()
    config = resolved.config
    return Run(id=job_id, name=config.name, status="queued", mode=config.aggregation.mode,
               source="controller", config_submitted=resolved.submitted_text,
               overrides=json.dumps(resolved.overrides),
               config_resolved=config.model_dump_json(), output_dir=str(resolved.output_dir),
               num_steps=config.num_steps, created_at=now, updated_at=now, **fields)


def write_config_file(resolved: Resolved) -> None:
    """The job's config in its new folder: folder 0700, file 0600 (the owner's only),
    the file never written through a link."""
    resolved.output_dir.parent.mkdir(parents=True, exist_ok=True)
    resolved.output_dir.mkdir(mode=0o700, exist_ok=True)
    text = yaml.safe_dump(resolved.file_config, sort_keys=False)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    with os.fdopen(os.open(resolved.output_dir / JOB_CONFIG_FILE, flags, 0o600), "w",
                   encoding="utf-8") as out:
        out.write(text)


def parse_submit(body: bytes, content_type: str, query_overrides: list[str]) -> JobSubmit:
    if content_type.split(";")[0].strip().lower() in YAML_TYPES:
        text = body.decode("utf-8", errors="replace")
        return JobSubmit(config_yaml=text, overrides=query_overrides)
    payload = JobSubmit.model_validate_json(body or b"{}")
    if query_overrides:
        payload = payload.model_copy(update={"overrides": [*payload.overrides,
                                                            *query_overrides]})
    return payload


@router.post("", status_code=201, response_model=JobDetail, openapi_extra=SUBMIT_BODY,
             responses={**AUTH, **INVALID, 413: {"model": Message}},
             dependencies=[Depends(require_token)])
async def submit_job(request: Request, ctl: Ctl,
                     set_: Annotated[list[str], Query(alias="set", max_length=100)] = []  # noqa: B006
                     ) -> JobDetail | JSONResponse:
    """Submit one job. Body: JSON (``JobSubmit``) or the config itself as YAML
    (``Content-Type: application/yaml``, overrides in ``?set=key=value``). The job waits in
    status ``queued`` until a Ray slot is free. With an ``Idempotency-Key`` header, a
    submit repeating an earlier key returns that job (200) instead of a new one."""
    key = request.headers.get("idempotency-key")
    if key is not None and not 0 < len(key) <= 200:
        return unprocessable([Problem("Idempotency-Key", "1 to 200 characters")])
    if key is not None and (first := await run_in_threadpool(ctl.store.job_with_key, key)):
        return JSONResponse(job_detail(first, ctl.settings).model_dump(mode="json"))
    body = await request.body()
    try:
        payload = parse_submit(body, request.headers.get("content-type", ""), set_)
    except ValidationError as err:
        return unprocessable(request_problems(err.errors()))
    job_id = new_id()
    try:
        data, stored_text = submitted_config(payload.config, payload.config_yaml)
        taken = await run_in_threadpool(ctl.store.output_dirs)
        resolved = await run_in_threadpool(resolve_submission, ctl, data, payload.overrides,
                                           job_id, stored_text, taken)
    except ConfigTooLarge as err:
        raise HTTPException(413, err.detail) from None
    except SubmissionError as err:
        return unprocessable(err.problems, err.detail)
    job = new_job(resolved, job_id, idempotency_key=key)
    stored = await run_in_threadpool(ctl.store.add_job_once, job)
    if stored.id != job_id:  # the same key, submitted at the same moment: the first wins
        return JSONResponse(job_detail(stored, ctl.settings).model_dump(mode="json"))
    try:
        await run_in_threadpool(write_config_file, resolved)
    except OSError as err:
        job = ctl.store.transition(job_id, "failed", error=f"cannot write the job folder: {err}")
    enqueue(ctl)  # the queue's capacity check is the reconcile loop's (reconcile.py)
    return job_detail(job, ctl.settings)


@router.get("", response_model=JobList)
def list_jobs(request: Request, ctl: Ctl,
              status: Annotated[list[JobStatus] | None, Query()] = None,
              name: Annotated[str | None, Query(max_length=100)] = None,
              mode: Annotated[str | None, Query(max_length=32)] = None,
              sweep_id: Annotated[str | None, Query(max_length=32)] = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 50,
              offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> Response:
    """Jobs, newest first; filter by status (repeatable), name substring, mode, sweep."""
    key, version = str(request.url.query), ctl.store.version
    cached = ctl.list_cache.get(key)
    if cached is not None and cached[0] == version:  # dashboards poll the same page
        return Response(cached[1], media_type="application/json")
    jobs, total = ctl.store.list_jobs(status=status or (), name=name, mode=mode,
                                      sweep_id=sweep_id, limit=limit, offset=offset)
    body = JobList(items=[job_out(j) for j in jobs], total=total, limit=limit,
                   offset=offset).model_dump_json().encode()
    if len(ctl.list_cache) >= 64:
        ctl.list_cache.clear()
    ctl.list_cache[key] = (version, body)
    return Response(body, media_type="application/json")


def get_or_404(ctl: Controller, job_id: str) -> Run:
    job = ctl.store.get_job(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id}")
    return job


@router.get("/{job_id}", response_model=JobDetail, responses=NOT_FOUND)
def get_job(job_id: str, ctl: Ctl, request: Request, credentials: Credentials) -> JobDetail:
    """One job: status, configs (as submitted and as resolved), error and last log lines.
    Off loopback without the API or the job's token: without its events and log lines."""
    private = may_read(request, credentials, f"job:{job_id}")
    return job_detail(get_or_404(ctl, job_id), ctl.settings, private)


@router.post("/{job_id}/cancel", response_model=JobDetail,
             responses={**NOT_FOUND, **AUTH, 409: {"model": Message}, 503: {"model": Message}},
             dependencies=[Depends(require_token)])
def cancel_job(job_id: str, ctl: Ctl) -> JobDetail:
    """Stop the job's Ray job (its driver, and with it its actors), whatever the store
    says of it while Ray has not confirmed its end. Idempotent."""
    job = get_or_404(ctl, job_id)
    try:
        stopped = stop_in_ray(ctl.backend, job)
    except BackendUnavailable as err:
        raise HTTPException(503, f"cannot reach Ray to stop the job: {err}") from None
    if job.status in TERMINAL and not stopped:
        if job.status == "cancelled":
            return job_detail(job, ctl.settings)
        raise HTTPException(409, f"job {job_id} already {job.status}")
    job, changed = ctl.store.advance(job_id, "cancelled", error="cancelled by the user")
    if job is not None and not changed and stopped and job.status != "cancelled":
        job = ctl.store.overrule_end(job_id, job.status, "cancelled",  # Ray still ran it
                                     error="cancelled by the user")
    if job is not None and job.status != "cancelled":  # it ended meanwhile
        raise HTTPException(409, f"job {job_id} already {job.status}")
    return job_detail(job, ctl.settings)


@router.delete("/{job_id}", status_code=204, response_class=Response,
               responses={**NOT_FOUND, **AUTH, 409: {"model": Message}},
               dependencies=[Depends(require_token)])
def delete_job(job_id: str, ctl: Ctl, folder: bool = False) -> Response:
    """Forget an ended job: its row and metrics; with ``folder=true`` also the folder of a
    job this controller ran (never a registered job's, never outside the allowed roots,
    never through a link: a job folder that is a link, or below a link under its root, is
    a 409 naming it, and nothing is deleted)."""
    job = get_or_404(ctl, job_id)
    remove = folder and job.source == "controller"
    try:
        if remove:  # checked before the row goes: a refusal deletes nothing
            remove_job_folder(ctl.settings, job.output_dir, remove=False)
    except Escapes as err:
        raise refused_removal(err) from None
    if not ctl.store.delete_job(job_id):
        raise HTTPException(409, f"job {job_id} has not ended ({job.status}): cancel it first")
    try:
        if remove:
            remove_job_folder(ctl.settings, job.output_dir)
    except Escapes as err:  # a link swapped in meanwhile: the row is gone, the folder kept
        raise refused_removal(err) from None
    return Response(status_code=204)


def refused_removal(err: Escapes) -> HTTPException:
    return HTTPException(409, f"{err}; the controller never removes through it (delete "
                         "without folder=true to forget the job and keep what is there)")


@router.get("/{job_id}/metrics", response_model=MetricsOut, responses=NOT_FOUND)
def job_metrics(job_id: str, ctl: Ctl,
                names: Annotated[list[str] | None, Query(max_length=200)] = None,
                start: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
                end: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
                max_points: Annotated[int, Query(ge=1, le=100_000)] = 2000) -> Response:
    """Per-step metrics, column-oriented; ``names`` (repeatable or comma-separated) picks
    series, ``start``/``end`` a step range, ``max_points`` downsamples long runs."""
    get_or_404(ctl, job_id)
    wanted = split_names(names)
    rows, total = ctl.store.sample_metrics(job_id, point_budget(wanted, max_points), start, end)
    return json_response(metrics_out(job_id, rows, total, wanted))


def read_samples(job_id: str, request: Request, credentials: Credentials) -> None:
    """Samples hold held-out prompts and answers: open to loopback, else a token."""
    require_reader(request, credentials, f"job:{job_id}")


@router.get("/{job_id}/samples", response_model=SamplesOut,
            responses={**NOT_FOUND, **AUTH, 409: {"model": Message}},
            dependencies=[Depends(read_samples)])
def job_samples(job_id: str, ctl: Ctl,
                step: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
                evaluation: Annotated[bool | None, Query(alias="eval")] = None,
                limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
                tokens: bool = False,
                index: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None) -> Response:
    """Samples as text from the job folder's samples.jsonl (prompt, response, reward and
    its parts, advantage) and the steps that have some. ``step``: one rollout step
    (of evaluation samples, the weight version); ``eval``: evaluation samples only (true)
    or training ones only (false); ``index`` (with ``step``): the training sample of that
    row of the step's batch; at most ``limit``: a step's first, else the newest. A
    training sample's per-token record (``tokens``: text, observation, advantage, engine
    and trainer log-prob, entropy per response token) can be large: it is sent with
    ``tokens=true`` only, else ``has_tokens: true`` says the sample has one (the
    dashboard's table reads without, and asks ``?step=S&index=I&tokens=true`` for a
    sample opened). None yet: an empty list and a ``note``. Read by the confinement rule:
    a linked samples.jsonl is a 409 naming it; off loopback it needs the API or the job's
    token."""
    job = get_or_404(ctl, job_id)
    if index is not None and step is None:
        raise Unprocessable([Problem("query.index", "give step with index (a batch row of "
                                     "one rollout step)")])
    folder = ctl.samples.of(ctl.settings, job.output_dir)  # None: outside the allowed roots
    try:
        out = samples_out(job_id, folder, step, evaluation, limit, tokens=tokens,
                          batch_index=index)
    except Escapes as err:
        raise refused(err) from None
    return Response(out.model_dump_json(exclude_unset=True), media_type="application/json")


@router.post("/{job_id}/metrics", response_model=IngestResult,
             responses={**NOT_FOUND, **AUTH}, dependencies=[Depends(require_job_token)])
def ingest_metrics(job_id: str, batch: MetricsIngest, ctl: Ctl) -> IngestResult:
    """Steps from the job's driver (ControllerSink); a repeated step replaces the old one."""
    job = get_or_404(ctl, job_id)
    beyond = [i for i, r in enumerate(batch.rows) if r.step >= job.num_steps]
    if beyond:  # a step the job cannot have: refused whole, nothing stored
        raise Unprocessable([Problem(f"rows[{beyond[0]}].step", (
            f"{batch.rows[beyond[0]].step} is beyond the job's steps 0..{job.num_steps - 1}"))])
    rows = [(r.step, r.time if r.time is not None else time.time(), clean_metrics(r.metrics))
            for r in batch.rows]
    accepted = ctl.store.add_metrics(job_id, rows)
    ctl.metrics.ingested.inc(accepted)
    if batch.ray_job_id and not job.ray_job_id:
        ctl.store.update_run(job_id, ray_job_id=batch.ray_job_id, driver_pid=batch.driver_pid)
    if job.status == "pending" and rows:  # the driver runs, whatever Ray said last
        ctl.store.transition(job_id, "running")
    return IngestResult(accepted=accepted)


@router.post("/{job_id}/status", response_model=JobDetail,
             responses={**NOT_FOUND, **AUTH, 409: {"model": Message}, 503: {"model": Message}},
             dependencies=[Depends(require_job_token)])
def report_status(job_id: str, report: StatusReport, ctl: Ctl) -> JobDetail:
    """A driver reports its start or its end (ignored once the job has ended). For a job
    the controller submitted, an end Ray contradicts is refused (409): while Ray says the
    job runs, its end is recorded when the Ray job ends."""
    job = get_or_404(ctl, job_id)
    if report.status in TERMINAL:
        try:
            why = contradicted_end(ctl.backend, job, report.status)
        except BackendUnavailable as err:
            raise HTTPException(503, f"cannot reach Ray to check the job: {err}") from None
        if why is not None:
            raise HTTPException(409, why)
    job = ctl.store.transition(job_id, report.status, **(
        {"error": report.error} if report.error else {}))
    return job_detail(job, ctl.settings)


@router.post("/register", status_code=201, response_model=JobDetail,
             responses={**AUTH, **INVALID}, dependencies=[Depends(require_token)])
def register_job(payload: JobRegister, ctl: Ctl) -> JobDetail | JSONResponse:
    """A job started elsewhere (``ray job submit ... python -m services.train``) announces
    itself so it appears on the dashboard; it then posts its metrics like any job."""
    try:
        config = JobConfig.model_validate(payload.config)
    except ValidationError as err:
        return unprocessable(request_problems(err.errors()), prefix="config: ")
    except (ValueError, TypeError) as err:
        return unprocessable([Problem("config", str(err))], str(err))
    now = time.time()
    job = Run(id=new_id(), name=config.name, status="running", mode=config.aggregation.mode,
              source="registered", config_submitted=json.dumps(payload.config, indent=2),
              overrides="[]", config_resolved=config.model_dump_json(),
              output_dir=payload.output_dir, num_steps=config.num_steps, created_at=now,
              started_at=now, updated_at=now)
    ctl.store.add_jobs([job])
    return job_detail(job, ctl.settings)
