"""The one state machine of a run (a job, a training session, a reward-model training).

Every kind moves through the same statuses, forward only::

    queued ─► pending ─► running ─► succeeded | failed | cancelled

``queued``: stored, waiting for its turn and the cluster's room (reconcile.py, one queue);
``pending``: handed to Ray, not yet running (a session: its server is starting);
``running``: Ray runs it (a session: its server answers); the three ends are final, except
that :meth:`Store.overrule_end` may replace an end Ray contradicts. A status may skip
forward (a driver that reports ``running`` before the poller saw ``pending``), never move
back: of two racing changes the one that goes further wins, the store checks each with
one conditional UPDATE (:func:`earlier`).

A session's REST answers keep their own words for these (:data:`SESSION_WORDS`):
starting, ready, ended (closed, idle, or ended by its owner: its state is saved or it
was never started), failed.
"""

from __future__ import annotations

KINDS = ("job", "session", "train_rm")
"""What a run runs: a training job, a training session, a reward-model training."""
JOB_KINDS = ("job", "train_rm")
"""The kinds the jobs routes (``/api/jobs``) show; sessions have their own routes."""

QUEUED = "queued"
ACTIVE = ("pending", "running")
"""Statuses of a run that Ray runs (or is about to)."""
TERMINAL = ("succeeded", "failed", "cancelled")
STATUSES = (QUEUED, *ACTIVE, *TERMINAL)

RANK = {QUEUED: 0, "pending": 1, "running": 2, "succeeded": 3, "failed": 3, "cancelled": 3}
"""A status moves only to one of a higher rank: a late 'pending' never hides 'running'."""
ALLOWED = {status: tuple(after for after in STATUSES if RANK[after] > RANK[status])
           for status in STATUSES}
"""status -> the statuses it may move to (the ends: none)."""

SESSION_WORDS = {QUEUED: "queued", "pending": "starting", "running": "ready",
                 "succeeded": "ended", "cancelled": "ended", "failed": "failed"}
"""A session's status as its routes and the dashboard show it."""
SESSION_STATUSES = {"queued": (QUEUED,), "starting": ("pending",), "ready": ("running",),
                    "ended": ("succeeded", "cancelled"), "failed": ("failed",)}
"""The inverse of :data:`SESSION_WORDS` (a migration's downgrade, a filter)."""


def earlier(status: str) -> list[str]:
    """The statuses from which a run may move to ``status``."""
    return [before for before, after in ALLOWED.items() if status in after]


def session_word(status: str) -> str:
    """The word a session's routes use for run status ``status``."""
    return SESSION_WORDS[status]
