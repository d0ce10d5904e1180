"""The controller: ``create_app(settings)`` builds the FastAPI app; ``tally serve`` runs it.

    tally submit / dashboard ──► /api (FastAPI) ──► Store (SQLAlchemy: jobs, metrics, sweeps)
                                     │                  ▲            ▲
                                     ▼                  │ status     │ metrics (ControllerSink,
             Reconciler (background) ──► Ray job server ┘            │  back-fill from jsonl)
                 queue · status · logs     (JobSubmissionClient)     │
                                               └──► python -m services.train ──┘

Without ``TALLY_RAY_ADDRESS`` the app starts a local Ray head on startup and stops it on
shutdown (the embedded default); after a controller killed without its shutdown, the next
one re-adopts that head (``<data>/ray-head.json``) and the jobs on it run on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio.to_thread
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.controller import readiness
from services.controller.guard import RequestGuard
from services.controller.observability import (
    BodyLimitMiddleware,
    ControllerMetrics,
    TimingMiddleware,
)
from services.controller.problems import Unprocessable, answer_unprocessable
from services.controller.ray_head import LocalRayHead
from services.controller.ray_jobs import JobBackend, RayJobBackend
from services.controller.reconcile import Reconciler
from services.controller.schemas import Health, JobSubmit, ValidationErrorOut
from services.controller.settings import Settings
from services.controller.state import Controller
from services.controller.store import Store
from services.controller.submission import MAX_CONFIG_BYTES

STATIC = Path(__file__).resolve().parent / "static"
HEAD_MARKER = "ray-head.json"
"""The embedded head's pid, address and temp folder: a restarted controller re-adopts it."""
THREADS = 16
SUBMIT_BODY_BYTES = 2 * MAX_CONFIG_BYTES + 16 * 1024
"""A submit body: the config (JSON escaping may double it) and its overrides."""


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with our single 422 shape and the submit body's two media types."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["JobSubmit"] = JobSubmit.model_json_schema(
        ref_template="#/components/schemas/{model}")
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components.setdefault("ValidationErrorOut", ValidationErrorOut.model_json_schema(
        ref_template="#/components/schemas/{model}"))
    schema = json.loads(json.dumps(schema).replace(
        "#/components/schemas/HTTPValidationError", "#/components/schemas/ValidationErrorOut"))
    app.openapi_schema = schema
    return schema


def create_app(settings: Settings | None = None, backend: JobBackend | None = None) -> FastAPI:
    """The controller app. ``backend`` replaces Ray (tests); None: Ray, per settings."""
    from services.controller import routes_jobs, routes_sessions, routes_stream, routes_sweeps

    settings = settings or Settings.from_env()
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    settings.data_dir.chmod(0o700)  # the database, keys and job folders: the owner's only
    store = Store(settings.db_url)
    store.migrate()
    ctl = Controller(settings, store)
    if backend is not None:
        ctl.reconciler = Reconciler(store, backend, settings)
    ctl.metrics = ControllerMetrics(store.status_counts, ctl.reconcile_stats)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if ctl.reconciler is None:
            address = settings.ray_address
            if address is None:
                ctl.head = LocalRayHead(settings.ray_num_cpus, settings.data_dir / "ray-head.log",
                                        marker=settings.data_dir / HEAD_MARKER)
                address = await asyncio.to_thread(ctl.head.start)
            ctl.reconciler = Reconciler(
                store, RayJobBackend(address, settings.ray_call_timeout_s), settings)
        reconciler = ctl.reconciler
        # Few worker threads: the handlers are short and share one GIL; 40 threads (anyio's
        # default) only add switching and tail latency. What may wait long holds none:
        # forwarded session calls are async (session_calls.py), every Ray call is bounded
        # (ray_call_timeout_s), /healthz and /readyz read memory only.
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        await asyncio.to_thread(reconciler.backfill_unfinished)
        ctl.readiness = await asyncio.to_thread(readiness.check, ctl, STATIC)
        tasks = [asyncio.create_task(reconciler.run()),
                 asyncio.create_task(readiness.watch(ctl, STATIC))]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if ctl.head is not None:
                await asyncio.to_thread(reconciler.shutdown_embedded)
                await asyncio.to_thread(ctl.head.stop)
            store.close()

    app = FastAPI(title="Tally controller", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None,  # both load from a CDN; see /openapi.json
                  description="Jobs, sweeps and metrics of Tally RL post-training runs.")
    app.state.controller = ctl
    app.add_exception_handler(RequestValidationError, answer_unprocessable)
    app.add_exception_handler(Unprocessable, answer_unprocessable)  # the one 422 body
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes,
                       paths=dict.fromkeys(("/api/jobs", "/api/sweeps"), SUBMIT_BODY_BYTES))
    app.add_middleware(RequestGuard, settings=settings)  # before any body is read
    app.add_middleware(TimingMiddleware, metrics=lambda: ctl.metrics)
    app.include_router(routes_jobs.router)
    app.include_router(routes_stream.router)
    app.include_router(routes_sweeps.router)
    app.include_router(routes_sessions.router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.get("/healthz", tags=["service"])
    async def healthz() -> Health:
        """Liveness: the process serves (async, from memory: no worker thread, no I/O);
        ``database``: the last readiness check's; ``ray``: the job server used."""
        database = ctl.readiness is None or ctl.readiness.database
        ray = ctl.reconciler.backend.address if ctl.reconciler else "starting"
        return Health(status="ok" if database else "degraded", database=database, ray=ray)

    @app.get("/readyz", tags=["service"], response_model=readiness.Ready,
             responses={503: {"model": readiness.Ready}})
    async def readyz() -> JSONResponse:
        """Readiness: database, Ray job server (its resources reported) and static files,
        as last checked (at most a few seconds ago); 503 until all hold."""
        ready = ctl.readiness or readiness.NOT_CHECKED
        return JSONResponse(ready.model_dump(), 200 if ready.ready else 503)

    @app.get("/metrics", tags=["service"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    def prometheus() -> Response:
        """Prometheus metrics of the controller itself."""
        return Response(generate_latest(ctl.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    for path in ("/", "/jobs/{job_id}", "/sweeps/{sweep_id}"):
        app.add_api_route(path, page, include_in_schema=False, methods=["GET"])
    return app
