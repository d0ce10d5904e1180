"""The one submit path of jobs and training sessions: the steps both routes share.

1. parse and validate the config into Problems, every path confined to the allowed roots
   (:func:`resolve_submission`, SubmissionError: 422);
2. the cluster's capacity (:func:`room_for`): one larger than the whole cluster is
   refused, naming what it needs; one that does not fit what is free now, or has a queued
   job or session ahead of it, waits as ``queued``;
3. the row stored, and the reconcile loop woken (:func:`enqueue`), which starts the
   queue's jobs and sessions first come, first served (reconcile.py ``submit_queued``).

A job is always stored ``queued`` and its capacity is the reconcile loop's (a job too big
fails there at once); a session is started at once when it fits and nothing waits ahead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rollout.problems import Problem
from services.config.job import JobConfig
from services.controller.capacity import Capacity
from services.controller.run_states import QUEUED
from services.controller.state import Controller
from services.controller.submission import Resolved, SubmissionError, resolve
from services.runtime.placement import AUTOSCALING_ENV, job_needs, never_fits


def resolve_submission(ctl: Controller, data: dict[str, Any], overrides: list[str],
                       item_id: str, submitted_text: str, taken: Sequence[str] = ()
                       ) -> Resolved:
    """The config checked and its paths confined (SubmissionError: 422 with Problems)."""
    return resolve(data, overrides, ctl.settings, item_id, submitted_text, taken=taken)


def queued_ahead(ctl: Controller) -> int:
    """How many runs of every kind wait in the one queue (a new one goes behind them)."""
    return len(ctl.store.runs_with_status((QUEUED,)))


def room_for(ctl: Controller, config: JobConfig) -> str | None:
    """None when ``config``'s whole gang fits what is free now and nothing waits ahead;
    else why it waits. SubmissionError (422) when it can never fit the cluster (unless it
    autoscales); BackendUnavailable when Ray cannot be asked."""
    needs = job_needs(config)
    capacity = Capacity(ctl.backend.resources(), ctl.reconciler.admitted_needs())
    if capacity.never_fits(needs) and not os.environ.get(AUTOSCALING_ENV):
        why = never_fits(config, [capacity.total]) or "it can never fit this Ray cluster"
        raise SubmissionError(why, [Problem("config", why)])
    shortfall = capacity.shortfall(needs)
    if shortfall is not None:
        return shortfall
    if ahead := queued_ahead(ctl):
        return f"waiting behind {ahead} queued job(s) or session(s) (first come, first served)"
    return None


def enqueue(ctl: Controller) -> None:
    """The stored row is queued: the reconcile loop looks at the queue now."""
    if ctl.reconciler is not None:
        ctl.reconciler.poke()
