"""Streams of one job: its logs (proxied from Ray, bounded, with tail and follow) and live metrics
and status as server-sent events (what the dashboard's charts listen to)."""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, StreamingResponse

from services.controller.auth import Credentials, require_reader
from services.controller.job_files import (
    DEFAULT_TAIL_BYTES,
    Escapes,
    read_job_file,
    read_own_log,
    refused,
)
from services.controller.job_logs import StopDumps
from services.controller.ray_jobs import BackendUnavailable
from services.controller.reconcile import tail
from services.controller.routes_jobs import AUTH, NOT_FOUND, get_or_404
from services.controller.schemas import Message
from services.controller.state import Controller, Ctl
from services.controller.tables import ACTIVE, TERMINAL, Run
from services.controller.views import columns, job_out
from services.driver.run_dir import LOG_FILE

router = APIRouter(prefix="/api/jobs", tags=["streams"])
MAX_STREAMS, MAX_STREAMS_PER_JOB = 64, 8
"""Open SSE and log-follow connections, in all and per job (more: 429)."""
SSE_CHUNK = 1000
"""Steps per ``metrics`` event: a long backlog goes out in bounded pieces."""
POLL_S = 0.5
KEEPALIVE_S = 15.0
TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}
SSE = {200: {"description": "`metrics`, `status` and `end` events",
             "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def capped_stream(ctl: Controller, job_id: str, body: AsyncIterator[str]
                  ) -> AsyncIterator[str]:
    """``body``, counted among the open streams (429 when none is free). A stream counts
    while its generator lives: it frees itself when it ends, is dropped unstarted, or is
    cancelled by a disconnect."""
    live = ctl.streams.setdefault(job_id, weakref.WeakSet())
    if sum(len(s) for s in ctl.streams.values()) >= MAX_STREAMS or \
            len(live) >= MAX_STREAMS_PER_JOB:
        raise HTTPException(429, "too many open streams; close one and retry",
                            headers={"Retry-After": "5"})
    live.add(body)
    return body


MAX_READ_BYTES = 64 << 20
"""The most ``bytes`` one read of a log may ask for."""


def last_bytes(text: str, size: int) -> str:
    """The last ``size`` bytes of ``text`` (UTF-8; a character cut at the start replaced)."""
    data = text.encode("utf-8", errors="replace")
    return text if len(data) <= size else data[-size:].decode("utf-8", errors="replace")


def saved_logs(ctl: Controller, job: Run, size: int = DEFAULT_TAIL_BYTES) -> str | None:
    """The last ``size`` bytes of the controller's own copy of a finished job's output,
    else of the job folder's driver.log (read by the confinement rule: a link is a 409
    naming it, never followed; outside the allowed roots, never read)."""
    try:
        data = read_own_log(ctl.settings, job.id, size)
        if data is None:
            data = read_job_file(ctl.settings, job.output_dir, LOG_FILE, size)
    except Escapes as err:
        raise refused(err) from None
    except OSError:
        return None
    return None if data is None else data.decode("utf-8", errors="replace")


def ray_logs(ctl: Controller, job: Run) -> str | None:
    """The whole log from Ray while it has it (what follow skips: it was sent)."""
    if job.ray_submission_id and ctl.reconciler is not None:
        try:
            return ctl.backend.logs(job.ray_submission_id)
        except BackendUnavailable:
            pass
    return None


def read_allowed(job_id: str, request: Request, credentials: Credentials) -> None:
    """Logs and samples: open to loopback, else the API token or the job's own."""
    require_reader(request, credentials, f"job:{job_id}")


@router.get("/{job_id}/logs", response_class=PlainTextResponse, response_model=None,
            responses={**TEXT, **NOT_FOUND, **AUTH, 409: {"model": Message}},
            dependencies=[Depends(read_allowed)])
async def job_logs(job_id: str, ctl: Ctl,
                   tail_lines: Annotated[int | None, Query(alias="tail", ge=1, le=100_000)]
                   = None,
                   size: Annotated[int, Query(alias="bytes", ge=1, le=MAX_READ_BYTES)]
                   = DEFAULT_TAIL_BYTES,
                   follow: bool = False) -> PlainTextResponse | StreamingResponse:
    """The driver's output (a stopped driver's stack dumps as one line): from Ray while it
    has it, else the controller's copy, else the job folder's driver.log. At most its last
    ``bytes`` bytes (default 1 MiB); ``tail`` keeps the last lines of those; ``follow``
    streams new output until the job ends. A linked driver.log: 409 naming it."""
    job = await run_in_threadpool(get_or_404, ctl, job_id)
    from_ray = await run_in_threadpool(ray_logs, ctl, job)
    text = last_bytes(from_ray, size) if from_ray is not None else \
        await run_in_threadpool(saved_logs, ctl, job, size)
    if text is None:
        if job.status == "queued":
            text = ""
        else:
            raise HTTPException(404, f"no logs for job {job_id} (not run by Ray here)")
    following = follow and job.status in ACTIVE and job.ray_submission_id
    dumps = StopDumps()
    shown = dumps.feed(text) + ("" if following else dumps.flush())
    first = tail(shown, tail_lines) + "\n" if tail_lines and shown else shown
    if not following:
        return PlainTextResponse(first)
    sent = len(from_ray or "")  # of Ray's log, in characters: follow repeats it

    async def stream() -> AsyncIterator[str]:
        yield first
        seen = 0
        try:
            async for chunk in ctl.backend.follow(job.ray_submission_id):
                new = chunk[max(0, sent - seen):] if seen < sent else chunk
                seen += len(chunk)
                if new and (out := dumps.feed(new)):
                    yield out
            if rest := dumps.flush():
                yield rest
        except (RuntimeError, OSError) as err:
            yield f"\n[tally: log stream ended: {err}]\n"

    return StreamingResponse(capped_stream(ctl, job_id, stream()), media_type="text/plain")


def sse(event: str, data: object) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


@router.get("/{job_id}/events", response_model=None, responses={**SSE, **NOT_FOUND})
async def job_events(job_id: str, request: Request, ctl: Ctl,
                     after: Annotated[int, Query(ge=-1, le=2**31 - 1)] = -1
                     ) -> StreamingResponse:
    """Server-sent events: ``metrics`` (new steps after ``after``, column-oriented),
    ``status`` (the job whenever it changes) and a final ``end`` once the job ended."""
    await run_in_threadpool(get_or_404, ctl, job_id)
    async def stream() -> AsyncIterator[str]:
        last, last_seen, quiet = after, None, 0.0
        while not await request.is_disconnected():
            job = await run_in_threadpool(ctl.store.get_job, job_id)
            rows = await run_in_threadpool(ctl.store.read_metrics, job_id, last + 1,
                                           last + SSE_CHUNK)
            if rows:
                _, steps, series = columns(rows, ())
                yield sse("metrics", {"steps": steps, "series": series})
                last, quiet = steps[-1], 0.0
            state = job_out(job).model_dump() if job else None
            if state != last_seen:
                yield sse("status", state)
                last_seen, quiet = state, 0.0
            if job is None or (job.status in TERMINAL and not rows):
                yield sse("end", {"status": job.status if job else None})
                return
            if len(rows) == SSE_CHUNK:
                continue  # more of the backlog: no pause
            if quiet >= KEEPALIVE_S:
                yield ": keepalive\n\n"
                quiet = 0.0
            await asyncio.sleep(POLL_S)
            quiet += POLL_S

    return StreamingResponse(capped_stream(ctl, job_id, stream()),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
