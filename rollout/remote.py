"""One HTTP client for remote reward calls: a judge on an OpenAI-compatible server
(rollout/judge.ask_server) and a reward endpoint (``type: http``,
rollout/reward_parts/http.py). Standard library only.

    call ──► POST (timeout_s) ──► 2xx: the JSON reply
               │  timeout, refused or reset connection, 429, 5xx: retried after
               │      delay_k = backoff_s · 2^k · u_k,  u_k ~ U[0.5, 1],  k = 0 … max_retries − 1
               │      (Σ delays ≤ backoff_s · (2^max_retries − 1), the bound a test holds);
               │      a 429 or 503 with ``Retry-After`` (seconds or an HTTP date) waits
               │      max(delay_k, min(Retry-After, timeout_s)) instead: the server's
               │      word, but never longer than one call may take (a server that asks
               │      for more is as good as down for this call)
               │  any other 4xx, a reply that is not JSON: not retried
               └─ failed (after its retries, or not retried): None, counted in a CallTally;
                  the caller marks that call's samples unscored.

At most ``max_concurrency`` calls to one endpoint are in flight in this process
(:func:`limiter`), whichever shard or thread makes them. A step whose unscored share
exceeds the part's ``max_unscored_fraction`` raises (:func:`check_unscored`):
:class:`RemoteOutage` when the endpoint was unreachable or overloaded (a fault: the
driver restarts the job from its checkpoint), :class:`RemoteRefused` when it refused the
requests (a 4xx: a restart would be refused again).

The API key is read where the job runs, from an environment variable or a file only
its owner may read (:func:`read_api_key`), and lives only in the request headers: it is
never in a config, a log line or an error message.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import os
import random
import socket
import stat
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_LIMITS: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_LIMITS_LOCK = threading.Lock()


class RemoteOutage(RuntimeError):
    """A step's share of samples a remote endpoint left unscored (unreachable, timed
    out, overloaded) exceeds what its part allows. A fault: the driver restarts the job
    from its last checkpoint (services/driver/loop.failure)."""


class RemoteRefused(RuntimeError):
    """A remote endpoint refused a step's requests (a 4xx other than 429: a wrong key,
    URL or body); a restart would be refused again, so the job stops."""


@dataclass
class CallTally:
    """What a batch of remote calls cost: thread-safe, summed over shards."""

    failed_calls: int = 0
    """Calls that failed after their retries (or were not retried)."""
    retries: int = 0
    """Attempts made again after a retryable failure."""
    unscored: int = 0
    """Samples of failed calls."""
    refused: int = 0
    """Failed calls the endpoint refused (4xx other than 429: never retried)."""
    first_error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False,
                                  compare=False)

    def failed(self, num_samples: int, error: str, refused: bool) -> None:
        with self._lock:
            self.failed_calls += 1
            self.unscored += num_samples
            self.refused += int(refused)
            self.first_error = self.first_error or error

    def retried(self) -> None:
        with self._lock:
            self.retries += 1

    def add(self, other: CallTally) -> None:
        """Count ``other``'s calls too (a step's shards, summed)."""
        with self._lock:
            self.failed_calls += other.failed_calls
            self.retries += other.retries
            self.unscored += other.unscored
            self.refused += other.refused
            self.first_error = self.first_error or other.first_error

    def counts(self) -> dict[str, int]:
        """``reward/<name>/<key>`` counts: failed_calls and retries."""
        return {"failed_calls": self.failed_calls, "retries": self.retries}


@dataclass(frozen=True)
class RemoteSettings:
    """How one endpoint is called (from a part's config, with its key read)."""

    url: str
    timeout_s: float
    max_retries: int
    backoff_s: float
    max_concurrency: int
    api_key: str | None = field(default=None, repr=False)
    """Sent as ``Authorization: Bearer``; never printed (repr=False)."""

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def _open_key_file(api_key_file: str, field: str) -> Any:
    """The key file opened for reading: a regular file, reached without a link at its
    end, that neither group nor others may read or write (chmod 600)."""
    path = Path(api_key_file).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise ValueError(f"{field}.api_key_file: {path} cannot be opened "
                         f"({err.strerror}; a link is refused)") from None
    file = os.fdopen(fd, "rb")
    mode = os.fstat(file.fileno()).st_mode
    problem = ("is not a regular file" if not stat.S_ISREG(mode) else
               f"is readable or writable by group or others (mode {stat.S_IMODE(mode):o}); "
               "chmod 600 it" if mode & 0o077 else None)
    if problem is not None:
        file.close()
        raise ValueError(f"{field}.api_key_file: {path} {problem}")
    return file


def check_key_file(api_key_file: str | None, field: str) -> None:
    """Preflight: the key file is there and only its owner may read it (not read)."""
    if api_key_file is not None:
        _open_key_file(api_key_file, field).close()


def read_api_key(api_key_env: str | None, api_key_file: str | None,
                 field: str) -> str | None:
    """The key from ``$api_key_env`` or from ``api_key_file`` (:func:`check_key_file`'s
    rules); None without a source. ValueError naming ``field`` when the source is
    unusable."""
    if api_key_env is not None:
        key = os.environ.get(api_key_env, "").strip()
        if not key:
            raise ValueError(f"{field}.api_key_env: ${api_key_env} is not set (or empty) "
                             "where the job runs")
        return key
    if api_key_file is None:
        return None
    with _open_key_file(api_key_file, field) as file:
        key = file.read(65536).decode("utf-8", errors="replace").strip()
    if not key or any(c in key for c in "\r\n"):
        raise ValueError(f"{field}.api_key_file: {api_key_file} must hold one key on one "
                         "line")
    return key


def limiter(url: str, max_concurrency: int) -> threading.BoundedSemaphore:
    """The one semaphore of this endpoint and limit in this process."""
    with _LIMITS_LOCK:
        return _LIMITS.setdefault((url, max_concurrency),
                                  threading.BoundedSemaphore(max_concurrency))


def backoff_delay(attempt: int, backoff_s: float, rng: random.Random) -> float:
    """Seconds before retry ``attempt`` (0-based): backoff_s · 2^attempt · U[0.5, 1]."""
    return backoff_s * (2.0 ** attempt) * rng.uniform(0.5, 1.0)


def retry_after_s(err: BaseException, now: float | None = None) -> float | None:
    """Seconds a 429 or 503 answer's ``Retry-After`` header asks to wait (delay-seconds or
    an HTTP date, RFC 9110 §10.2.3); None without one, on another status or unreadable."""
    if not isinstance(err, urllib.error.HTTPError) or err.code not in (429, 503):
        return None
    value = (err.headers.get("Retry-After") if err.headers is not None else None) or ""
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            date = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if date.tzinfo is None:
            return None
        seconds = date.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if seconds == seconds and seconds != float("inf") else None


def retry_delay(asked_s: float | None, attempt: int, settings: RemoteSettings,
                rng: random.Random) -> float:
    """Seconds before retry ``attempt``: the backoff, or what a 429/503 asked for
    (``asked_s``, :func:`retry_after_s`) when longer, capped at one call's ``timeout_s``
    (module docstring)."""
    delay = backoff_delay(attempt, settings.backoff_s, rng)
    return delay if asked_s is None else max(delay, min(asked_s, settings.timeout_s))


def _retryable(err: BaseException) -> bool:
    """Timeouts, refused or dropped connections, 429 and 5xx are worth another try."""
    if isinstance(err, urllib.error.HTTPError):
        return err.code == 429 or err.code >= 500
    return isinstance(err, urllib.error.URLError | TimeoutError | socket.timeout
                      | ConnectionError | http.client.HTTPException)


def _describe(err: BaseException) -> str:
    """One line about a failed attempt (no header, hence no key, is ever in it)."""
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code} {err.reason}"
    if isinstance(err, urllib.error.URLError):
        return f"{type(err.reason).__name__}: {err.reason}"
    return f"{type(err).__name__}: {err}"


def post_json(settings: RemoteSettings, body: Any, tally: CallTally, num_samples: int,
              rng: random.Random | None = None) -> Any | None:
    """``body`` POSTed to ``settings.url`` with retries; the JSON reply, or None when the
    call failed (counted in ``tally`` with its ``num_samples``)."""
    rng = rng or random.Random()
    data = json.dumps(body).encode()
    gate = limiter(settings.url, settings.max_concurrency)
    for attempt in range(settings.max_retries + 1):
        try:
            request = urllib.request.Request(settings.url, data=data,
                                             headers=settings.headers(), method="POST")
            with gate, urllib.request.urlopen(request, timeout=settings.timeout_s) as reply:
                return json.loads(reply.read())
        except (OSError, http.client.HTTPException, ValueError) as err:
            asked_s = retry_after_s(err)  # before close: its headers
            if isinstance(err, urllib.error.HTTPError):
                err.close()  # its body is not read: free the connection now
            retry = _retryable(err) and attempt < settings.max_retries
            if not retry:
                refused = isinstance(err, urllib.error.HTTPError) and not _retryable(err)
                tail = f" after {attempt} retries" if _retryable(err) else ""
                tally.failed(num_samples, f"{settings.url}: {_describe(err)}{tail}", refused)
                return None
            tally.retried()
            time.sleep(retry_delay(asked_s, attempt, settings, rng))
    return None  # unreachable: the last attempt returns or fails above


def check_unscored(name: str, tally: CallTally, num_samples: int,
                   max_unscored_fraction: float) -> None:
    """Raise when the samples of failed calls exceed ``max_unscored_fraction`` of a
    step's ``num_samples``: RemoteRefused if any failed call was refused (4xx), else
    RemoteOutage (a fault the driver restarts from the checkpoint)."""
    if num_samples == 0 or tally.unscored <= max_unscored_fraction * num_samples:
        return
    what = (f"reward {name}: {tally.unscored}/{num_samples} samples unscored by failed "
            f"calls (max_unscored_fraction {max_unscored_fraction}); {tally.failed_calls} "
            f"calls failed, first: {tally.first_error}")
    if tally.refused:
        raise RemoteRefused(what)
    raise RemoteOutage(what)
