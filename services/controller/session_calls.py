"""The controller's calls to a session's server, none of them holding a worker thread.

A session call may take minutes (a ``save`` of a large model, a ``forward_backward`` on a
long batch) or never answer (a hung rank): each is awaited on an async HTTP client with a
timeout (``session_call_timeout_s``: then 504, naming it), so hung calls hold no thread of
the pool that the other routes (``/api/jobs``, ``/healthz``) run on. The short database
and file reads around them run in that pool, one at a time per call.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from fastapi import HTTPException
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from services.controller.run_states import ACTIVE, QUEUED, session_word
from services.controller.session_rows import controller_headers, end_from_ray, ready_url
from services.controller.state import Controller
from services.controller.tables import Run

MUTATING = ("forward_backward", "optim_step", "load")
"""Calls after which the stored step, tokens and loss are refreshed."""
POLL_S = 0.25
QUEUED_RETRY_S = 10
"""The Retry-After of a call to a session still queued (its turn may take a job's end)."""
STATE_TIMEOUT_S = 10.0
"""Longest a ``/state`` or ``/close`` of a session may take (both answer at once)."""


def row_of(ctl: Controller, session_id: str) -> Run:
    row = ctl.store.get_session(session_id)
    if row is None:
        raise HTTPException(404, f"session {session_id}: no such session")
    return row


def gone(row: Run) -> HTTPException:
    why = (f" (its state is saved at {row.saved_path})" if row.saved_path else
           f": {row.error}" if row.error else "")
    return HTTPException(409, f"session {row.id} is {session_word(row.status)}{why}")


def still_queued(ctl: Controller, row: Run) -> HTTPException:
    """503 with Retry-After for a call to a session that waits in the queue, saying its
    place in it (one queue over every kind of run) and why it waits, as a cold start's
    503 says it is still starting."""
    queue = [run.id for run in ctl.store.runs_with_status((QUEUED,))]
    place = queue.index(row.id) + 1 if row.id in queue else 1
    waiting = ctl.reconciler.waiting.get(row.id) if ctl.reconciler is not None else None
    return HTTPException(503, f"session {row.id} is queued (position {place} of "
                         f"{len(queue)} in the queue)" + (f": {waiting}" if waiting else ""),
                         headers={"Retry-After": str(QUEUED_RETRY_S)})


def _look(ctl: Controller, session_id: str, ask_ray: bool
          ) -> tuple[Run, str | None]:
    """The row and its server's URL (None while it starts); 503 while it is queued, 409
    once it ended."""
    row = row_of(ctl, session_id)
    if row.status == QUEUED:
        raise still_queued(ctl, row)
    if row.status not in ACTIVE:
        raise gone(row)
    if (url := ready_url(row, ctl.settings.sessions_advertise_host)) is not None:
        if row.status != "running":
            ctl.store.advance(row.id, "running")
        return row, url
    if ask_ray and (ended := end_from_ray(ctl.store, ctl.backend, ctl.settings, row)):
        raise gone(ended)
    return row, None


async def session_address(ctl: Controller, session_id: str
                          ) -> tuple[Run, str]:
    """The live session's server, waiting (asleep, no thread held) while it starts."""
    deadline = time.monotonic() + ctl.settings.session_start_timeout_s
    last_ray_check = 0.0
    while True:
        ask_ray = time.monotonic() - last_ray_check > 2.0
        last_ray_check = time.monotonic() if ask_ray else last_ray_check
        row, url = await run_in_threadpool(_look, ctl, session_id, ask_ray)
        if url is not None:
            return row, url
        if time.monotonic() > deadline:
            raise HTTPException(503, f"session {session_id} is still starting after "
                                f"{ctl.settings.session_start_timeout_s:g} s")
        await asyncio.sleep(POLL_S)


def _client(timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)))


async def refresh(ctl: Controller, row: Run, address: str
                  ) -> dict[str, Any] | None:
    """The session's own state, copied into its row; None when it does not answer."""
    try:
        async with _client(STATE_TIMEOUT_S) as http:
            answer = await http.get(f"{address}/state",
                                    headers=controller_headers(ctl.settings, row))
        state = answer.json()
        last = state.get("last") or {}
        update = {"step": state["step"], "tokens": state["tokens"],
                  "pending_calls": state["pending_calls"], "loss": last.get("loss", row.loss)}
    except (httpx.HTTPError, ValueError, KeyError, AttributeError):
        return None
    await run_in_threadpool(ctl.store.update_run, row.id, **update)
    return state


async def forward(ctl: Controller, session_id: str, verb: str, body: bytes) -> Response:
    """``verb`` on the session's server, its answer passed back as it is; 504 after
    ``session_call_timeout_s``; 409 or 503 when the session is gone or silent."""
    row, address = await session_address(ctl, session_id)
    timeout_s = ctl.settings.session_call_timeout_s
    try:
        async with _client(timeout_s) as http:
            answer = await http.post(f"{address}/{verb}", content=body, headers={
                **controller_headers(ctl.settings, row), "content-type": "application/json"})
    except httpx.TimeoutException:
        raise HTTPException(504, f"session {session_id}: {verb} did not answer within "
                            f"{timeout_s:g} s (session_call_timeout_s, "
                            "TALLY_SESSION_CALL_TIMEOUT_S); it may still run: GET "
                            f"/api/sessions/{session_id} says its state") from None
    except httpx.TransportError:
        ended = await run_in_threadpool(end_from_ray, ctl.store, ctl.backend, ctl.settings,
                                        row)
        if ended is not None:
            raise gone(ended) from None
        raise HTTPException(503, f"session {session_id} did not answer {verb}") from None
    if verb in MUTATING and answer.status_code == 200:
        await refresh(ctl, row, address)
    return Response(answer.content, answer.status_code, media_type="application/json")


async def close(ctl: Controller, row: Run, url: str) -> bool:
    """Ask the session to end; False when it does not answer."""
    try:
        async with _client(STATE_TIMEOUT_S) as http:
            await http.post(f"{url}/close", headers=controller_headers(ctl.settings, row))
        return True
    except httpx.HTTPError:
        return False
