"""A training session's process as the controller sees it: where it listens, what it
holds, and how it ended (what Ray or the session says, written into its row; the API's
calls and the reconcile loop both ask)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from rollout.confined import read_inside
from services.config.job import JobConfig
from services.controller.job_logs import failure_cause
from services.controller.ray_jobs import BackendUnavailable, JobBackend
from services.controller.session_secret import session_secret
from services.controller.settings import Settings
from services.controller.store import Store
from services.controller.tables import TERMINAL, TrainingSessionRow
from services.runtime.placement import job_needs
from services.sessions.server import SESSION_FILE

LAUNCH_FILE = ".launch.json"
"""The environment a session's server starts with (written at submit, 0600): a queued
session is started by the reconcile loop later."""

SAVE_TIMEOUT_S = 120.0


MAX_STATE_BYTES = 64 << 10
"""A session.json is a few fields: a larger one is not read."""


def session_state(folder: str | Path) -> dict[str, Any]:
    """``<folder>/session.json`` read by the confinement rule (a link, or anything that
    is not a JSON object: {}, as a session still starting)."""
    try:
        data = read_inside(folder, SESSION_FILE, limit=MAX_STATE_BYTES)
        state = json.loads(data)
    except (OSError, ValueError):  # Escapes is a ValueError: a link is never read
        return {}
    return state if isinstance(state, dict) else {}


def session_host(host: object, advertised: str | None) -> str | None:
    """``host`` when it can be a Ray node's address: an IP of loopback or a private
    network (never link-local: a cloud's metadata server), or the name the controller
    itself advertises (``TALLY_SESSIONS_ADVERTISE_HOST``); None otherwise. Anyone who
    can write the session's folder writes session.json: the controller sends the
    session's secret and its callers' data to the address it names."""
    if not isinstance(host, str) or not host:
        return None
    if advertised and host == advertised:
        return host
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.is_link_local or address.is_multicast or address.is_unspecified:
        return None
    return host if address.is_loopback or address.is_private else None


def ready_url(row: TrainingSessionRow, advertised: str | None = None) -> str | None:
    """Where the session's server listens (its node's address, or the ``advertised``
    host), once its ``session.json`` says ready with an address that can be a node's and
    a port in 1..65535 (else: not ready, and never called)."""
    state = session_state(row.output_dir)
    if state.get("state") != "ready":
        return None
    host, port = session_host(state.get("host"), advertised), state.get("port")
    if host is None or type(port) is not int or not 0 < port < 65536:
        return None
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def controller_headers(settings: Settings, row: TrainingSessionRow) -> dict[str, str]:
    """The bearer token the session's server takes: the controller's secret for it."""
    return {"authorization": f"Bearer {session_secret(settings.data_dir, row.id)}"}


def session_needs(row: TrainingSessionRow) -> dict[str, float]:
    """The resources the session's gang holds ({} for an unreadable config)."""
    try:
        return job_needs(JobConfig.model_validate_json(row.config_resolved))
    except ValueError:
        return {}


def live_session_needs(store: Store) -> list[dict[str, float]]:
    """The resources each live session's gang holds ({} for an unreadable config)."""
    return [session_needs(row) for row in store.live_sessions()]


def queued_sessions(store: Store) -> list[TrainingSessionRow]:
    """The sessions waiting for the cluster, oldest first."""
    with store.sessions() as session:
        return list(session.scalars(select(TrainingSessionRow).where(
            TrainingSessionRow.status == "queued").order_by(
            TrainingSessionRow.created_at, TrainingSessionRow.id)))


def move_queued(store: Store, session_id: str, status: str, **values: Any
                ) -> TrainingSessionRow | None:
    """A queued session to ``status`` (starting, ended, failed); None when it is no
    longer queued (ended meanwhile, or started)."""
    with store._write() as session:
        row = session.get(TrainingSessionRow, session_id)
        if row is None or row.status != "queued":
            return None
        row.status = status
        for name, value in values.items():
            setattr(row, name, value)
        row.updated_at = time.time()
        return row


def write_launch(folder: Path, env: dict[str, str]) -> None:
    """The server's environment in the session's folder, 0600, never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    with os.fdopen(os.open(folder / LAUNCH_FILE, flags, 0o600), "w") as out:
        out.write(json.dumps(env))


def launch(backend: JobBackend, settings: Settings, row: TrainingSessionRow) -> None:
    """Submit the session's server to Ray (BackendUnavailable, RuntimeError: refused)."""
    env = json.loads(read_inside(row.output_dir, LAUNCH_FILE, limit=MAX_STATE_BYTES))
    backend.submit(row.ray_submission_id, f"{settings.python} -m services.sessions.server "
                   f"{row.output_dir}", {str(k): str(v) for k, v in env.items()},
                   {"tally_session_id": row.id})


def start_queued(store: Store, backend: JobBackend, settings: Settings,
                 row: TrainingSessionRow) -> bool:
    """Start a queued session (the reconcile loop, its turn come); False when Ray cannot
    be reached (the next pass retries)."""
    try:
        launch(backend, settings, row)
    except BackendUnavailable:
        return False
    except (RuntimeError, OSError, ValueError) as err:
        if "already exists" not in str(err):
            move_queued(store, row.id, "failed", error=f"Ray refused the session: {err}")
            return True
    if move_queued(store, row.id, "starting") is None:  # ended while it was started
        with contextlib.suppress(BackendUnavailable):
            backend.stop(row.ray_submission_id)
    return True


def end_from_ray(store: Store, backend: JobBackend, row: TrainingSessionRow
                 ) -> TrainingSessionRow | None:
    """The session says it ended (idle or closed: its process is on its way out), or Ray
    says its job ended (or forgot it): the row says how; None while it runs."""
    state = session_state(row.output_dir)
    if state.get("state") == "ended" and state.get("reason") in ("idle", "closed"):
        return store.update_session(row.id, status="ended",
                                    saved_path=state.get("saved_path"))
    try:
        info = backend.info(row.ray_submission_id)
    except BackendUnavailable:
        return None
    if info is not None and info.status not in TERMINAL:
        return None
    if info is None:
        error = "Ray has no record of this session any more (its cluster was restarted)"
    else:
        logs = None
        with contextlib.suppress(BackendUnavailable):
            logs = backend.logs(row.ray_submission_id)
        error = failure_cause(logs, info.message)
    return store.update_session(row.id, status="failed", error=error)


def poll_sessions(store: Store, backend: JobBackend) -> None:
    """Every live session whose Ray job ended: ended (idle or closed, its state saved)
    or failed (the cause from its logs)."""
    for row in store.live_sessions():
        end_from_ray(store, backend, row)


def save_before_the_head_stops(store: Store, settings: Settings) -> None:
    """The controller stops the Ray head it started, and its sessions with it: each
    ready one saves its state first (``save shutdown``) and ends; one that cannot is
    failed, saying why."""
    for row in store.live_sessions():
        saved, why = None, "it was still starting"
        if (url := ready_url(row, settings.sessions_advertise_host)) is not None:
            try:
                answer = httpx.post(f"{url}/save", json={"name": "shutdown"},
                                    timeout=SAVE_TIMEOUT_S,
                                    headers=controller_headers(settings, row))
                if answer.status_code == 200:
                    saved = answer.json()["path"]
                else:
                    why = answer.json().get("detail", answer.text)
            except (httpx.HTTPError, ValueError) as err:
                why = f"it did not save: {err}"
        if saved is not None:
            store.update_session(row.id, status="ended", saved_path=saved)
        else:
            store.update_session(row.id, status="failed", error=(
                f"the controller stopped, and with it the Ray head it had started ({why})"))
