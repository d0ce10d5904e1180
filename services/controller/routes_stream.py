"""Streams of one job: its logs (proxied from Ray, with tail and follow) and live metrics
and status as server-sent events (what the dashboard's charts listen to)."""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, StreamingResponse

from services.controller.job_logs import StopDumps
from services.controller.ray_jobs import BackendUnavailable
from services.controller.reconcile import tail
from services.controller.routes_jobs import NOT_FOUND, get_or_404
from services.controller.state import Controller, Ctl
from services.controller.tables import ACTIVE, TERMINAL, Job
from services.controller.views import columns, job_out
from services.driver.run_dir import LOG_FILE

router = APIRouter(prefix="/api/jobs", tags=["streams"])
MAX_STREAMS, MAX_STREAMS_PER_JOB = 64, 8
"""Open SSE and log-follow connections, in all and per job (more: 429)."""
SSE_CHUNK = 1000
"""Steps per ``metrics`` event: a long backlog goes out in bounded pieces."""
TAIL_BYTES = 8 << 20
"""``tail`` of a saved log reads at most this much from the end of the file."""
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


def read_tail(path: Path, lines: int | None) -> str:
    """The last ``lines`` lines of a file, read backwards from its end (at most
    TAIL_BYTES); the whole file when ``lines`` is None."""
    with path.open("rb") as file:
        if lines is None:
            return file.read().decode("utf-8", errors="replace")
        end = file.seek(0, 2)
        start, data = end, b""
        while start > 0 and data.count(b"\n") <= lines and end - start < TAIL_BYTES:
            start = max(0, start - (64 << 10))
            file.seek(start)
            data = file.read(end - start)
    return data.decode("utf-8", errors="replace")


def saved_logs(ctl: Controller, job: Job, lines: int | None = None) -> str | None:
    """The copy of the logs in the job folder (never outside the allowed roots)."""
    if not ctl.settings.inside_roots(job.output_dir):
        return None
    try:
        return read_tail(Path(job.output_dir) / LOG_FILE, lines)
    except OSError:
        return None


def current_logs(ctl: Controller, job: Job, lines: int | None = None) -> str | None:
    """From Ray while it has them, else the copy saved in the job folder (only its last
    ``lines`` read)."""
    if job.ray_submission_id and ctl.reconciler is not None:
        try:
            text = ctl.backend.logs(job.ray_submission_id)
            if text is not None:
                return text
        except BackendUnavailable:
            pass
    return saved_logs(ctl, job, lines)


@router.get("/{job_id}/logs", response_class=PlainTextResponse, response_model=None,
            responses={**TEXT, **NOT_FOUND})
async def job_logs(job_id: str, ctl: Ctl,
                   tail_lines: Annotated[int | None, Query(alias="tail", ge=1, le=100_000)]
                   = None, follow: bool = False) -> PlainTextResponse | StreamingResponse:
    """The driver's output (a stopped driver's stack dumps as one line). ``tail`` keeps
    the last lines; ``follow`` streams new output until the job ends."""
    job = await run_in_threadpool(get_or_404, ctl, job_id)
    text = await run_in_threadpool(current_logs, ctl, job, tail_lines)
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

    async def stream() -> AsyncIterator[str]:
        yield first
        seen = 0
        try:
            async for chunk in ctl.backend.follow(job.ray_submission_id):
                new = chunk[max(0, len(text) - seen):] if seen < len(text) else chunk
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
