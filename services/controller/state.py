"""What the endpoints share (``request.app.state.controller``) and its FastAPI dependency."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any
from weakref import WeakSet

from fastapi import Depends, HTTPException, Request

from services.controller.job_samples import SampleIndexes
from services.controller.observability import ControllerMetrics
from services.controller.ray_head import LocalRayHead
from services.controller.ray_jobs import JobBackend
from services.controller.reconcile import Reconciler
from services.controller.settings import Settings
from services.controller.store import Store


@dataclass
class Controller:
    settings: Settings
    store: Store
    reconciler: Reconciler | None = None
    head: LocalRayHead | None = None
    metrics: ControllerMetrics = field(init=False)
    list_cache: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    """GET /api/jobs answers by query string, valid while the store's version holds."""
    streams: dict[str, WeakSet] = field(default_factory=dict)
    """Open SSE and log-follow streams per job (routes_stream caps them)."""
    readiness: Any = None
    """The last readiness check (services/controller/readiness.py ``Ready``)."""
    samples: SampleIndexes = field(default_factory=SampleIndexes)
    """Where each sample of the samples.jsonl files read lately is (job_samples.py)."""

    @property
    def backend(self) -> JobBackend:
        if self.reconciler is None:
            raise HTTPException(503, "the controller is still connecting to Ray")
        return self.reconciler.backend

    def reconcile_stats(self) -> dict[str, int]:
        r = self.reconciler
        return {"errors": r.errors, "backfilled": r.backfilled} if r else {}


def controller(request: Request) -> Controller:
    return request.app.state.controller


Ctl = Annotated[Controller, Depends(controller)]
