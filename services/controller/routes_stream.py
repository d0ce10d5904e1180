"""Streams of one job: its logs (proxied from Ray, with tail and follow) and live metrics
and status as server-sent events (what the dashboard's charts listen to)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, StreamingResponse

from services.controller.ray_jobs import BackendUnavailable
from services.controller.reconcile import LOG_FILE, tail
from services.controller.routes_jobs import NOT_FOUND, get_or_404
from services.controller.state import Controller, Ctl
from services.controller.tables import ACTIVE, TERMINAL, Job
from services.controller.views import columns, job_out

router = APIRouter(prefix="/api/jobs", tags=["streams"])
POLL_S = 0.5
KEEPALIVE_S = 15.0
TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}
SSE = {200: {"description": "`metrics`, `status` and `end` events",
             "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def saved_logs(job: Job) -> str | None:
    path = Path(job.output_dir) / LOG_FILE
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def current_logs(ctl: Controller, job: Job) -> str | None:
    """From Ray while it has them, else the copy saved in the job folder."""
    if job.ray_submission_id and ctl.reconciler is not None:
        try:
            text = ctl.backend.logs(job.ray_submission_id)
            if text is not None:
                return text
        except BackendUnavailable:
            pass
    return saved_logs(job)


@router.get("/{job_id}/logs", response_class=PlainTextResponse, response_model=None,
            responses={**TEXT, **NOT_FOUND})
async def job_logs(job_id: str, ctl: Ctl,
                   tail_lines: Annotated[int | None, Query(alias="tail", ge=1, le=100_000)]
                   = None, follow: bool = False) -> PlainTextResponse | StreamingResponse:
    """The driver's output. ``tail`` keeps the last lines; ``follow`` streams new output
    until the job ends."""
    job = await run_in_threadpool(get_or_404, ctl, job_id)
    text = await run_in_threadpool(current_logs, ctl, job)
    if text is None:
        if job.status == "queued":
            text = ""
        else:
            raise HTTPException(404, f"no logs for job {job_id} (not run by Ray here)")
    first = tail(text, tail_lines) + "\n" if tail_lines and text else text
    if not (follow and job.status in ACTIVE and job.ray_submission_id):
        return PlainTextResponse(first)

    async def stream() -> AsyncIterator[str]:
        yield first
        seen = 0
        try:
            async for chunk in ctl.backend.follow(job.ray_submission_id):
                new = chunk[max(0, len(text) - seen):] if seen < len(text) else chunk
                seen += len(chunk)
                if new:
                    yield new
        except (RuntimeError, OSError) as err:
            yield f"\n[tally: log stream ended: {err}]\n"

    return StreamingResponse(stream(), media_type="text/plain")


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
            rows = await run_in_threadpool(ctl.store.read_metrics, job_id, last + 1, None)
            if rows:
                _, steps, series, _ = columns(rows, None, len(rows))
                yield sse("metrics", {"steps": steps, "series": series})
                last, quiet = steps[-1], 0.0
            state = job_out(job).model_dump() if job else None
            if state != last_seen:
                yield sse("status", state)
                last_seen, quiet = state, 0.0
            if job is None or (job.status in TERMINAL and not rows):
                yield sse("end", {"status": job.status if job else None})
                return
            if quiet >= KEEPALIVE_S:
                yield ": keepalive\n\n"
                quiet = 0.0
            await asyncio.sleep(POLL_S)
            quiet += POLL_S

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
