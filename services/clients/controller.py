"""The driver's side of the controller: a MetricsSink that posts each step's metrics, and
self-registration of jobs the controller did not submit (``ray job submit``).

Training never waits on the controller: ``write`` only appends to a bounded queue; a
background thread posts batches with retries, and when the queue is full the oldest rows
are dropped (``metrics.jsonl`` stays the source of truth; the controller back-fills from
it). Nothing here raises into training. Standard library only (urllib), so a driver
without the server extras still reports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("tally.controller_client")
URL_ENV, JOB_ENV, TOKEN_ENV = "TALLY_CONTROLLER_URL", "TALLY_JOB_ID", "TALLY_JOB_TOKEN"
REFUSED_REGISTRATION = ("controller %s refused to register this job (%s, with %s): pass a "
                        "token it accepts as TALLY_JOB_TOKEN in the job's runtime env; "
                        "metrics stay in metrics.jsonl")


def _post(url: str, payload: dict[str, Any], token: str | None, timeout: float) -> Any:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def _ray_identity() -> dict[str, Any]:
    """Ray's job id and this driver's PID, once the driver joined a cluster."""
    try:
        import ray

        if ray.is_initialized():
            return {"ray_job_id": ray.get_runtime_context().get_job_id(),
                    "driver_pid": os.getpid()}
    except Exception:  # identity is a nicety; never fail the job for it
        pass
    return {}


class ControllerSink:
    """MetricsSink posting to ``<url>/api/jobs/<id>/metrics`` from a background thread.

    With ``job_id=None`` the thread first registers the job (``registration`` payload)."""

    def __init__(self, url: str, job_id: str | None, token: str | None = None,
                 registration: dict[str, Any] | None = None, batch_size: int = 100,
                 flush_interval_s: float = 0.5, max_queue: int = 10_000,
                 timeout_s: float = 5.0, max_backoff_s: float = 10.0) -> None:
        self.url, self.job_id, self.token = url.rstrip("/"), job_id, token
        self.registration = registration
        self.batch_size, self.flush_interval_s = batch_size, flush_interval_s
        self.timeout_s, self.max_backoff_s = timeout_s, max_backoff_s
        self.queue: deque[dict[str, Any]] = deque(maxlen=max_queue)
        self.dropped = self.sent = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._identity_sent = False
        self.refused = False
        """The controller refused the registration (401/403): nothing more is queued."""
        self._thread = threading.Thread(target=self._run, name="tally-controller-sink",
                                        daemon=True)
        self._thread.start()

    # ---- MetricsSink ---------------------------------------------------------------------

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.refused:
            return
        try:
            clean = {k: (float(v) if math.isfinite(float(v)) else None)
                     for k, v in metrics.items()}
            with self._lock:
                if len(self.queue) == self.queue.maxlen:
                    self.dropped += 1
                self.queue.append({"step": int(step), "time": time.time(), "metrics": clean})
            if len(self.queue) >= self.batch_size:
                self._wake.set()
        except Exception:  # never into training
            log.debug("controller sink: cannot queue step %s", step, exc_info=True)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued (for at most ``timeout_s``), then stop the thread."""
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def finish(self, status: str, error: str | None = None) -> None:
        """Report the job's end (after close); a few quick tries, never raises.

        A job the controller submitted to Ray is still running in Ray's eyes while its
        driver says this: the controller answers 409 and records the end from Ray's own
        status once the Ray job ends (docs/controller.md), so 409 is an answer, not a
        failure to retry."""
        if not self.job_id:
            return
        payload = {"status": status, "error": error[-20_000:] if error else None}
        for attempt in range(3):
            try:
                _post(f"{self.url}/api/jobs/{self.job_id}/status", payload, self.token,
                      self.timeout_s)
                return
            except urllib.error.HTTPError as err:
                if err.code == 409:
                    log.debug("controller %s: the end of %s comes from Ray", self.url,
                              self.job_id)
                    return
                time.sleep(0.5 * (attempt + 1))
            except (OSError, ValueError):
                time.sleep(0.5 * (attempt + 1))
        log.warning("controller %s: could not report status %s", self.url, status)

    # ---- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.0
        while True:
            self._wake.wait(backoff or self.flush_interval_s)
            self._wake.clear()
            closing = self._closing.is_set()
            try:
                self._register()
                while self._send_batch():
                    pass
                backoff = 0.0
            except (OSError, ValueError) as err:  # down, refused, or a bad answer: retry
                backoff = min(self.max_backoff_s, max(0.5, backoff * 2))
                log.debug("controller %s unreachable (%s); retry in %.1fs", self.url, err,
                          backoff)
                if closing:
                    return
            if closing and not self.queue:
                return

    def _register(self) -> None:
        if self.job_id is not None or self.registration is None:
            return
        try:
            answer = _post(f"{self.url}/api/jobs/register", self.registration, self.token,
                           self.timeout_s)
        except urllib.error.HTTPError as err:
            if err.code not in (401, 403):
                raise
            self.registration, self.refused = None, True  # not retried; the queue goes
            with self._lock:
                self.dropped += len(self.queue)
                self.queue.clear()
            log.warning(REFUSED_REGISTRATION, self.url, err.code,
                        "the token in TALLY_JOB_TOKEN" if self.token else "no token")
            return
        self.job_id = str(answer["id"])
        log.info("registered with the controller as job %s", self.job_id)

    def _send_batch(self) -> bool:
        if self.job_id is None:
            return False
        with self._lock:
            batch = [self.queue[i] for i in range(min(self.batch_size, len(self.queue)))]
        if not batch:
            return False
        payload: dict[str, Any] = {"rows": batch}
        if not self._identity_sent:
            payload.update(_ray_identity())
        _post(f"{self.url}/api/jobs/{self.job_id}/metrics", payload, self.token,
              self.timeout_s)
        self._identity_sent = self._identity_sent or "ray_job_id" in payload
        posted = {id(row) for row in batch}  # rows dropped meanwhile are simply gone
        with self._lock:
            while self.queue and id(self.queue[0]) in posted:
                self.queue.popleft()
        self.sent += len(batch)
        return bool(self.queue)


def error_text(err: BaseException) -> str:
    """The failure's cause in one line, as the job view shows it (``ValueError: boom``;
    a message of several lines joined with "; "); the traceback is in the job's log."""
    text = "".join(traceback.format_exception_only(err)).strip()
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


@contextlib.contextmanager
def controller_sinks(config: Any, output_dir: Path) -> Iterator[list[Any]]:
    """``[ControllerSink]`` when ``TALLY_CONTROLLER_URL`` is set, else ``[]``; reports
    succeeded / failed (with the error) when the block ends.

    The job presents only ``TALLY_JOB_TOKEN`` (the controller puts the job's own token
    there; a ``ray job submit`` user passes one), never ``TALLY_API_TOKEN`` from its
    environment. Without it a registration goes without a token; a controller that needs
    one refuses it, and the sink says so in one line and stops reporting."""
    url = os.environ.get(URL_ENV)
    if not url:
        yield []
        return
    job_id = os.environ.get(JOB_ENV) or None
    token = os.environ.get(TOKEN_ENV) or None  # a job presents only its own token
    registration = None if job_id else {
        "config": config.model_dump(mode="json", exclude_unset=True),
        "output_dir": str(Path(output_dir).resolve())}
    sink = ControllerSink(url, job_id, token, registration)
    try:
        yield [sink]
    except BaseException as err:
        sink.close()
        sink.finish("failed", error_text(err))
        raise
    sink.close()
    sink.finish("succeeded")
