"""What Ray says of a training session's process, written into its row (the API's
calls and the reconcile loop both ask)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from services.controller.job_logs import failure_cause
from services.controller.ray_jobs import BackendUnavailable, JobBackend
from services.controller.store import Store
from services.controller.tables import SESSION_LIVE, TERMINAL, TrainingSessionRow
from services.sessions.server import read_state


def end_from_ray(store: Store, backend: JobBackend, row: TrainingSessionRow
                 ) -> TrainingSessionRow | None:
    """Ray says the session's job ended (or forgot it): the row says how; None while it
    runs."""
    try:
        info = backend.info(row.ray_submission_id)
    except BackendUnavailable:
        return None
    if info is not None and info.status not in TERMINAL:
        return None
    state = read_state(Path(row.output_dir)) or {}
    if state.get("state") == "ended" and state.get("reason") in ("idle", "closed"):
        return store.update_session(row.id, status="ended",
                                        saved_path=state.get("saved_path"))
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
        if row.status in SESSION_LIVE:
            end_from_ray(store, backend, row)
