"""The controller's own health: Prometheus metrics and two ASGI middlewares
(request timing, and the request body size limit)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

Scope = dict[str, Any]
ASGIApp = Callable[..., Any]


class ControllerMetrics:
    """One registry per app (several apps may live in one test process)."""

    def __init__(self, jobs_by_status: Callable[[], dict[str, int]],
                 reconcile_stats: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tally_http_requests_total", "HTTP requests handled",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("tally_http_request_duration_seconds",
                                 "HTTP request latency", ["method", "route"],
                                 registry=self.registry,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5))
        self.ingested = Counter("tally_metric_rows_ingested_total",
                                "Training steps received from drivers", registry=self.registry)
        self.registry.register(_StoreCollector(jobs_by_status, reconcile_stats))


class _StoreCollector:
    def __init__(self, jobs_by_status: Callable[[], dict[str, int]],
                 reconcile_stats: Callable[[], dict[str, int]]) -> None:
        self.jobs_by_status, self.reconcile_stats = jobs_by_status, reconcile_stats

    def collect(self) -> Any:
        jobs = GaugeMetricFamily("tally_jobs", "Jobs in the store by status", labels=["status"])
        for status, count in self.jobs_by_status().items():
            jobs.add_metric([status], count)
        yield jobs
        stats = self.reconcile_stats()
        yield CounterMetricFamily("tally_reconcile_errors", "Failed reconcile passes or Ray "
                                  "calls", value=stats.get("errors", 0))
        yield CounterMetricFamily("tally_backfilled_rows", "Steps back-filled from "
                                  "metrics.jsonl", value=stats.get("backfilled", 0))


class TimingMiddleware:
    """Counts and times requests by route template (never by raw path)."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], ControllerMetrics | None]) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            metrics = self.metrics()
            if metrics is not None:
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                method = scope.get("method", "")
                metrics.requests.labels(method, route, str(status)).inc()
                metrics.latency.labels(method, route).observe(time.perf_counter() - started)


LIMIT_SETTING = "server.max_request_bytes"
LIMIT_HEADER = "x-tally-max-request-bytes"
"""Every answer carries the body limit, so a client can size its calls before a 413."""


class BodyLimitMiddleware:
    """413 for a request body over ``limit`` bytes (declared or streamed); ``paths`` set
    a smaller limit for some paths (the submit endpoints: no parser sees a huge config).

    The 413 is ``{"detail", "setting": "server.max_request_bytes", "limit"}`` (the
    detail names the setting, its variable and the limit); every answer carries the
    limit in ``x-tally-max-request-bytes``."""

    def __init__(self, app: ASGIApp, limit: int, paths: dict[str, int] | None = None) -> None:
        self.app, self.default, self.paths = app, limit, paths or {}

    async def _reject(self, send: Any, limit: int, path: str) -> None:
        where = (f"{LIMIT_SETTING} (TALLY_MAX_REQUEST_BYTES)" if limit == self.default else
                 f"the fixed limit of {path} (a config is at most half of it)")
        body = json.dumps({"detail": f"request body over {limit} bytes: {where} is {limit}",
                           "setting": LIMIT_SETTING if limit == self.default else path,
                           "limit": limit}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (LIMIT_HEADER.encode(), str(self.default).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = (LIMIT_HEADER.encode(), str(self.default).encode())

        async def tagged(message: dict[str, Any]) -> None:  # the limit on every answer
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, tagged)
            return
        path = scope.get("path", "")
        limit = min(self.default, self.paths.get(path, self.default))
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(send, limit, path)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, tagged)  # a disconnect: let the app see it
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._reject(send, limit, path)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, tagged)
