"""A training session's process as the controller sees it: where it listens, what it
holds, how it starts and how it ended (what Ray or the session says, written into its run
row; the API's calls and the reconcile loop's one poller both ask)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import shlex
from pathlib import Path
from typing import Any

import httpx

from rollout.confined import read_inside
from services.controller.job_env import run_env
from services.controller.job_logs import failure_cause
from services.controller.ray_jobs import BackendUnavailable, JobBackend
from services.controller.session_secret import session_secret
from services.controller.settings import Settings
from services.controller.store import Store
from services.controller.tables import ACTIVE, TERMINAL, Run
from services.sessions.server import SESSION_FILE

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


def ready_url(row: Run, advertised: str | None = None) -> str | None:
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


def controller_headers(settings: Settings, row: Run) -> dict[str, str]:
    """The bearer token the session's server takes: the controller's secret for it."""
    return {"authorization": f"Bearer {session_secret(settings.data_dir, row.id)}"}


def launch(backend: JobBackend, settings: Settings, row: Run) -> None:
    """Submit the session's server to Ray, its environment rebuilt from its row
    (job_env.py ``run_env``; BackendUnavailable, RuntimeError: refused)."""
    backend.submit(row.ray_submission_id or "", f"{shlex.quote(settings.python)} -m "
                   f"services.sessions.server {shlex.quote(row.output_dir)}",
                   run_env(settings, row), {"tally_session_id": row.id})


def start_queued(store: Store, backend: JobBackend, settings: Settings, row: Run) -> bool:
    """Start a queued session (the reconcile loop, its turn come); False when Ray cannot
    be reached (the next pass retries)."""
    try:
        launch(backend, settings, row)
    except BackendUnavailable:
        return False
    except (RuntimeError, OSError, ValueError) as err:
        if "already exists" not in str(err):
            store.advance(row.id, "failed", log_tail="",
                          error=f"Ray refused the session: {err}")
            return True
    if not store.advance(row.id, "pending")[1]:  # ended while it was started
        with contextlib.suppress(BackendUnavailable):
            backend.stop(row.ray_submission_id or "")
    return True


def end_session(store: Store, row: Run, status: str, **values: Any) -> Run | None:
    """The session to ``status`` (an end), its end confirmed (no log left to save)."""
    return store.advance(row.id, status, log_tail="", **values)[0]


def poll_session(store: Store, backend: JobBackend, settings: Settings, row: Run
                 ) -> Run | None:
    """The one poller's step for a session: ready once its server says so; ended (idle
    or closed, its state saved) once it says so; failed once Ray says its job ended (the
    cause from its logs). The row as it is then; None while Ray cannot be asked."""
    if row.status not in ACTIVE:  # ended here before Ray confirmed it: nothing to save
        return store.update_run(row.id, log_tail="")
    state = session_state(row.output_dir)
    if state.get("state") == "ended" and state.get("reason") in ("idle", "closed"):
        return end_session(store, row, "succeeded", saved_path=state.get("saved_path"))
    if row.status == "pending" and ready_url(row, settings.sessions_advertise_host):
        return store.advance(row.id, "running")[0]
    try:
        info = backend.info(row.ray_submission_id or "")
    except BackendUnavailable:
        return None
    if info is not None and info.status not in TERMINAL:
        return row
    if info is None:
        error = "Ray has no record of this session any more (its cluster was restarted)"
    else:
        logs = None
        with contextlib.suppress(BackendUnavailable):
            logs = backend.logs(row.ray_submission_id or "")
        error = failure_cause(logs, info.message)
    return end_session(store, row, "failed", error=error)


def end_from_ray(store: Store, backend: JobBackend, settings: Settings, row: Run
                 ) -> Run | None:
    """:func:`poll_session` for a call that found no server: the row once it ended,
    None while it runs (or Ray cannot be asked)."""
    polled = poll_session(store, backend, settings, row)
    return polled if polled is not None and polled.status in TERMINAL else None


def save_before_the_head_stops(store: Store, settings: Settings) -> None:
    """The controller stops the Ray head it started, and its sessions with it: each
    ready one saves its state first (``save shutdown``) and ends; one that cannot is
    failed, saying why."""
    for row in store.sessions_with_status(ACTIVE):
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
            end_session(store, row, "succeeded", saved_path=saved)
        else:
            end_session(store, row, "failed", error=(
                f"the controller stopped, and with it the Ray head it had started ({why})"))
