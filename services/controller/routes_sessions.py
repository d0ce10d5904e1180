"""``/api/sessions``: the training API (services/sessions) on the controller.

A session is a run of kind ``session`` (one table, one queue, one state machine with the
jobs: services/controller/run_states.py; its answers say starting, ready and ended for
pending, running and the good ends). It is started like a job (config checks, the
cluster's capacity, a Ray job that places its gang with ``reserve_job``) and then answers
its calls itself: this router
checks the caller (the API token, or the session's own token), waits while the session
starts, and forwards each call to the session's server (on its Ray node's address;
session_calls.py, async with timeouts), whose answer (422s naming ``data[i].field``
included) it passes back unchanged. What it keeps of a session
(step, tokens, loss) is refreshed after every call for the dashboard; the session's
numbers themselves live in its process, which a controller restart does not touch.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from rollout.problems import Problem
from services.config.job import JobConfig
from services.controller.auth import require_session_token, require_token, session_token
from services.controller.problems import unprocessable
from services.controller.ray_jobs import BackendUnavailable
from services.controller.routes_jobs import new_id
from services.controller.run_states import ACTIVE, QUEUED, session_word
from services.controller.session_calls import close, forward, refresh, row_of
from services.controller.session_rows import end_from_ray, end_session, launch, ready_url
from services.controller.session_secret import hand_over, session_secret
from services.controller.state import Controller, Ctl
from services.controller.submission import (
    ConfigTooLarge,
    SubmissionError,
    load_config_object,
)
from services.controller.submit_service import enqueue, resolve_submission, room_for
from services.controller.tables import Run
from services.sessions.server import CONFIG_FILE

router = APIRouter(prefix="/api/sessions", tags=["sessions"])
VERBS = ("forward_backward", "forward", "optim_step", "sample", "save", "load")


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any] = Field(default_factory=dict)
    """Job-config-like: ``rollout`` (model, engine, sampling), ``trainer`` (layout, loss,
    lora); a top-level ``lora`` is read as ``trainer.lora``."""
    idle_timeout_s: float | None = Field(default=None, gt=0, le=7 * 24 * 3600)
    """End (after saving) once this long without a call; None: the controller's
    ``TALLY_SESSION_IDLE_TIMEOUT_S``."""


def session_out(row: Run, waiting: str | None = None, **extra: Any
                ) -> dict[str, Any]:
    """The session as the API shows it; ``waiting``: why a queued one waits."""
    return {"id": row.id, "status": session_word(row.status), "model": row.model,
            "world_size": row.world_size, "step": row.step, "tokens": row.tokens,
            "loss": row.loss, "pending_calls": row.pending_calls,
            "saved_path": row.saved_path, "error": row.error, "output_dir": row.output_dir,
            "created_at": row.created_at, "updated_at": row.updated_at,
            "waiting": waiting if row.status == QUEUED else None, **extra}


def waiting_of(ctl: Controller, row: Run) -> str | None:
    """Why a queued session waits (what the reconcile loop last found)."""
    return ctl.reconciler.waiting.get(row.id) if ctl.reconciler is not None else None


def session_data(config: dict[str, Any]) -> dict[str, Any]:
    """The submitted config as a job config: ``lora`` moved under ``trainer``, one
    engine."""
    data = copy.deepcopy(config)
    if "lora" in data:
        trainer = data.setdefault("trainer", {})
        if not isinstance(trainer, dict) or "lora" in trainer:
            raise SubmissionError("lora: give it once, at the top or as trainer.lora",
                                  [Problem("lora", "given twice (top level and trainer.lora)")])
        trainer["lora"] = data.pop("lora")
    rollout = data.setdefault("rollout", {})
    if isinstance(rollout, dict) and isinstance(rollout.get("engine", {}), dict):
        rollout.setdefault("engine", {})["num_engines"] = 1
    return data


def check_session_config(config: JobConfig) -> None:
    problems: list[Problem] = []
    if config.trainer.backend != "fsdp":
        problems.append(Problem("trainer.backend", f"sessions run the fsdp backend, not "
                                f"{config.trainer.backend}"))
    if config.rollout.engine.type != "torch":
        problems.append(Problem("rollout.engine.type", "sessions sample with the torch "
                                f"engine, not {config.rollout.engine.type}"))
    if problems:
        raise SubmissionError.of(*problems)


def start_session(ctl: Controller, config: dict[str, Any], idle_timeout_s: float | None = None
                  ) -> Run:
    """Check, admit and submit a session by the submit service (SubmissionError: 422;
    HTTPException else): started at once when its gang fits what is free and nothing
    waits ahead, else stored ``queued`` (the reconcile loop starts it in its turn)."""
    settings = ctl.settings
    load_config_object(config)
    session_id = new_id()
    resolved = resolve_submission(ctl, session_data(config), [], session_id, json.dumps(config))
    check_session_config(resolved.config)
    if len(ctl.store.sessions_with_status((QUEUED, *ACTIVE))) >= settings.max_sessions:
        raise HTTPException(429, f"{settings.max_sessions} sessions are live "
                            "(TALLY_MAX_SESSIONS); end one first (DELETE /api/sessions/{id})")
    folder = settings.sessions_dir / session_id
    final = resolved.config.model_copy(update={"output_dir": str(folder)})
    try:
        waiting = room_for(ctl, final)
    except BackendUnavailable:
        raise HTTPException(503, "the Ray job server cannot be reached") from None
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)  # the owner's only
    (folder / CONFIG_FILE).write_text(final.model_dump_json(indent=2))
    # the secret goes by a 0600 file, not env_vars: Ray's job list shows every runtime_env
    hand_over(folder, session_secret(settings.data_dir, session_id))
    row = session_row(ctl, session_id, resolved.submitted_text, final, idle_timeout_s,
                      QUEUED if waiting else "pending")
    if waiting:
        ctl.reconciler.waiting[session_id] = waiting
        ctl.store.add_run(row)
        enqueue(ctl)
        return row
    try:  # submitted before it is stored: the reconcile loop never sees a row Ray lacks
        launch(ctl.backend, settings, row)
    except (BackendUnavailable, RuntimeError) as err:
        raise HTTPException(503, f"Ray refused the session: {err}") from None
    ctl.store.add_run(row)
    return row


def session_row(ctl: Controller, session_id: str, submitted: str, final: JobConfig,
                idle_timeout_s: float | None, status: str) -> Run:
    """The session's run row: everything its server is started with (now or from the
    queue: job_env.py ``run_env``) is in it, nothing in its folder."""
    now = time.time()
    # beside the Ray head this controller started, the session is on this machine:
    # loopback; on a cluster, its node's IP (the server's default) unless overridden
    advertise = ctl.settings.sessions_advertise_host or (
        "127.0.0.1" if ctl.head is not None else None)
    return Run(
        id=session_id, kind="session", name=final.name, status=status,
        mode=final.aggregation.mode, source="controller", num_steps=final.num_steps,
        model=final.rollout.model, world_size=final.trainer.world_size,
        config_submitted=submitted, overrides="[]", config_resolved=final.model_dump_json(),
        output_dir=final.output_dir, ray_submission_id=f"tally-session-{session_id}",
        step=0, tokens=0, pending_calls=0, created_at=now, updated_at=now,
        idle_timeout_s=(idle_timeout_s if idle_timeout_s is not None
                        else ctl.settings.session_idle_timeout_s),
        advertise_host=advertise)


@router.post("", status_code=201, dependencies=[Depends(require_token)])
async def create_session(body: SessionCreate, ctl: Ctl) -> Response:
    """Start a session: a trainer group and one engine holding ``config``'s model. It
    answers 201 at once (status ``starting``, or ``queued`` with a ``waiting`` reason while
    the cluster cannot hold its gang); its first call waits until it is ready.
    ``token`` (only with ``TALLY_API_TOKEN``) opens this session's calls and nothing else."""
    try:
        row = await run_in_threadpool(start_session, ctl, body.config, body.idle_timeout_s)
    except ConfigTooLarge as err:
        raise HTTPException(413, err.detail) from None
    except SubmissionError as err:
        return unprocessable(err.problems, err.detail, "config: ")
    token = session_token(ctl.settings.api_token, row.id) if ctl.settings.api_token else None
    return JSONResponse(session_out(row, waiting_of(ctl, row), token=token), 201)


@router.get("")
def list_sessions(ctl: Ctl) -> dict[str, Any]:
    """The latest sessions, newest first (what the dashboard lists)."""
    return {"items": [session_out(row, waiting_of(ctl, row))
                      for row in ctl.store.list_sessions()]}


def _verb_route(verb: str) -> None:
    async def call(session_id: str, request: Request, ctl: Ctl) -> Response:
        body = await request.body()
        return await forward(ctl, session_id, verb, body)

    call.__name__ = f"session_{verb}"
    call.__doc__ = f"``{verb}`` on the session (services/sessions/runtime.py)."
    router.add_api_route(f"/{{session_id}}/{verb}", call, methods=["POST"],
                         dependencies=[Depends(require_session_token)])


for _verb in VERBS:
    _verb_route(_verb)


@router.get("/{session_id}", dependencies=[Depends(require_session_token)])
async def get_session(session_id: str, ctl: Ctl) -> dict[str, Any]:
    """The session: its step, pending forward_backward calls, tokens and last metrics
    (live from the session while it runs)."""
    row = await run_in_threadpool(row_of, ctl, session_id)
    live = None
    if row.status in ACTIVE:
        if (url := ready_url(row, ctl.settings.sessions_advertise_host)) is not None:
            live = await refresh(ctl, row, url)
        if live is None:
            await run_in_threadpool(end_from_ray, ctl.store, ctl.backend, ctl.settings, row)
        row = await run_in_threadpool(row_of, ctl, session_id)
    return session_out(row, waiting_of(ctl, row), last=(live or {}).get("last"),
                       pending_mode=(live or {}).get("pending_mode"))


@router.delete("/{session_id}", dependencies=[Depends(require_session_token)])
async def delete_session(session_id: str, ctl: Ctl) -> dict[str, Any]:
    """End the session (its trainer ranks and engine stop; nothing is saved: ``save``
    first to keep the weights)."""
    row = await run_in_threadpool(row_of, ctl, session_id)
    if row.status == QUEUED:  # never started: nothing runs in Ray yet
        row = await run_in_threadpool(end_session, ctl.store, row, "cancelled") or row
    if row.status in ACTIVE:
        url = ready_url(row, ctl.settings.sessions_advertise_host)
        if url is None or not await close(ctl, row, url):
            try:
                await run_in_threadpool(ctl.backend.stop, row.ray_submission_id)
            except BackendUnavailable:
                raise HTTPException(503, "the Ray job server cannot be reached") from None
        row = await run_in_threadpool(end_session, ctl.store, row, "cancelled") or row
    return session_out(row)
