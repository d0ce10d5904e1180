"""Ray jobs behind a small interface: submit, status, stop, logs, follow.

:class:`RayJobBackend` wraps ``ray.job_submission.JobSubmissionClient`` against one job
server address, and asks Ray's state API what the cluster holds (:meth:`resources`). Its
calls block (HTTP): the API and the reconcile loop run them in threads, each bounded by
``timeout_s`` (a job server that accepts and never answers is BackendUnavailable then, not
a thread held for good). Tests of the API use a fake with the same methods.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from services.controller.job_env import CONTROLLER_ONLY

RAY_TO_TALLY = {"PENDING": "pending", "RUNNING": "running", "SUCCEEDED": "succeeded",
                "FAILED": "failed", "STOPPED": "cancelled"}
STATE_LIMIT = 10_000
"""Most entries one state-API listing returns (Ray's own cap); more: "Ray does not say"."""


class BackendUnavailable(RuntimeError):
    """The Ray job server cannot be reached (nothing about the job is known)."""


@dataclass(frozen=True)
class RayJobInfo:
    status: str
    """A Tally status: pending, running, succeeded, failed or cancelled."""
    message: str | None = None
    ray_job_id: str | None = None


class JobBackend(Protocol):
    address: str

    def submit(self, submission_id: str, entrypoint: str, env_vars: dict[str, str],
               metadata: dict[str, str]) -> str: ...
    def info(self, submission_id: str) -> RayJobInfo | None: ...
    def stop(self, submission_id: str) -> bool: ...
    def logs(self, submission_id: str) -> str | None: ...
    def follow(self, submission_id: str) -> AsyncIterator[str]: ...
    def find_submission(self, ray_job_id: str, driver_pid: int) -> str | None: ...
    def resources(self) -> dict[str, tuple[float, float]] | None: ...


def bounded_client(address: str, timeout_s: float) -> Any:
    """A JobSubmissionClient whose every HTTP request (the version check of its
    constructor included) gives up after ``timeout_s``: Ray's own sets no timeout."""
    from ray.job_submission import JobSubmissionClient

    class Bounded(JobSubmissionClient):  # type: ignore[misc]
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", timeout_s)
            return super()._do_request(method, endpoint, **kwargs)

    return Bounded(address)


def _not_found(err: Exception) -> bool:
    text = str(err)
    return "404" in text or "does not exist" in text or "not found" in text.lower()


class RayJobBackend:
    """JobSubmissionClient, created on first use and re-created after a connection error."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._client: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._client is None:
                try:  # requests' Timeout is an OSError too
                    self._client = bounded_client(self.address, self.timeout_s)
                except (ConnectionError, OSError) as err:
                    raise BackendUnavailable(f"Ray job server {self.address}: {err}") from err
            return self._client

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        client = self._get()
        try:
            return getattr(client, method)(*args, **kwargs)
        except (ConnectionError, OSError) as err:
            with self._lock:
                self._client = None
            raise BackendUnavailable(f"Ray job server {self.address}: {err}") from err

    def submit(self, submission_id: str, entrypoint: str, env_vars: dict[str, str],
               metadata: dict[str, str]) -> str:
        """``env_vars``: what this job adds to the head's scrubbed environment (its own
        token, its folder); one of the controller's own credentials is a ValueError."""
        leaked = sorted(CONTROLLER_ONLY.intersection(env_vars))
        if leaked:  # a bug of the caller, never a job's to see
            raise ValueError(f"a job's env_vars may not hold {', '.join(leaked)}")
        return str(self._call("submit_job", entrypoint=entrypoint, submission_id=submission_id,
                              runtime_env={"env_vars": env_vars}, metadata=metadata))

    def info(self, submission_id: str) -> RayJobInfo | None:
        try:
            details = self._call("get_job_info", submission_id)
        except RuntimeError as err:
            if isinstance(err, BackendUnavailable) or not _not_found(err):
                raise
            return None
        status = str(getattr(details.status, "value", details.status))
        return RayJobInfo(RAY_TO_TALLY.get(status, "pending"), details.message,
                          details.job_id)

    def stop(self, submission_id: str) -> bool:
        try:
            return bool(self._call("stop_job", submission_id))
        except RuntimeError as err:
            if isinstance(err, BackendUnavailable) or not _not_found(err):
                raise
            return False

    def logs(self, submission_id: str) -> str | None:
        try:
            return str(self._call("get_job_logs", submission_id))
        except RuntimeError as err:
            if isinstance(err, BackendUnavailable) or not _not_found(err):
                raise
            return None

    async def follow(self, submission_id: str) -> AsyncIterator[str]:
        """The job's whole log from the start, then new chunks until it ends."""
        async for chunk in self._get().tail_job_logs(submission_id):
            yield chunk

    def find_submission(self, ray_job_id: str, driver_pid: int) -> str | None:
        """The submission whose driver is this (job id, pid): job ids repeat across
        clusters, a (job id, driver pid) pair on the controller's cluster does not."""
        for details in self._call("list_jobs"):
            driver = details.driver_info
            if (details.job_id == ray_job_id and details.submission_id and driver is not None
                    and str(driver.pid) == str(driver_pid)):
                return str(details.submission_id)
        return None

    def resources(self) -> dict[str, tuple[float, float]] | None:
        """(used, total) of each cluster resource (CPU, GPU, custom ones); None when Ray
        does not say. From Ray's state API (``ray.util.state``, through the job server
        with its auth): total = the alive nodes' resources; used = the bundles of every
        created placement group (ours or not) and the actors outside placement groups
        (short tasks are not counted)."""
        from ray.util.state import list_actors, list_nodes, list_placement_groups
        from ray.util.state.exception import RayStateApiException, ServerUnavailable

        asked = {"address": self.address, "timeout": max(1, round(self.timeout_s)),
                 "limit": STATE_LIMIT}
        try:
            nodes = list_nodes(filters=[("state", "=", "ALIVE")], **asked)
            groups = list_placement_groups(filters=[("state", "=", "CREATED")], detail=True,
                                           **asked)
            actors = list_actors(filters=[("state", "=", "ALIVE")], detail=True, **asked)
        except (ServerUnavailable, ConnectionError, OSError) as err:
            raise BackendUnavailable(f"Ray job server {self.address}: {err}") from err
        except RayStateApiException:
            return None  # a Ray without the state API: admission by max_running_jobs only
        total = _add(node.resources_total for node in nodes)
        used = _add([*(bundle.get("unit_resources") for group in groups
                       for bundle in group.bundles or ()),
                     *(actor.required_resources for actor in actors
                       if not actor.placement_group_id)])
        out = {name: (used.get(name, 0.0), amount) for name, amount in total.items()
               if name not in ("memory", "object_store_memory") and not name.startswith("node:")}
        if not out:  # a head just started has not reported yet: never guess "it fits"
            raise BackendUnavailable(f"Ray at {self.address} has not reported its resources")
        return out


def _add(resources: Iterable[dict[str, float] | None]) -> dict[str, float]:
    """Resource dicts summed by name."""
    out: dict[str, float] = {}
    for amounts in resources:
        for name, amount in (amounts or {}).items():
            out[str(name)] = out.get(str(name), 0.0) + float(amount)
    return out
