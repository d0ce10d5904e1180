"""The controller's settings: one pydantic model, read from ``TALLY_*`` environment variables.

| variable | field | default |
|---|---|---|
| ``TALLY_DATA_DIR`` | data_dir | ``~/.tally`` |
| ``TALLY_DATABASE_URL`` | database_url | ``sqlite:///<data_dir>/controller.db`` |
| ``TALLY_RAY_ADDRESS`` | ray_address | none: start a local Ray head |
| ``TALLY_API_TOKEN`` | api_token | none: no auth (loopback only) |
| ``TALLY_PUBLIC_URL`` | public_url | ``http://127.0.0.1:<port>`` |
| ``TALLY_ALLOWED_ROOTS`` | allowed_roots | the data folder only |
| ``TALLY_ALLOWED_HOSTS`` | allowed_hosts | loopback, bind address, public URL host |
| ``TALLY_MAX_REQUEST_BYTES`` (old name ``TALLY_MAX_BODY_BYTES``) | max_request_bytes | 1 MiB |
| ``TALLY_MAX_RUNNING_JOBS`` | max_running_jobs | 2 |
| ``TALLY_RAY_NUM_CPUS`` | ray_num_cpus | 4 |
| ``TALLY_SESSION_CALL_TIMEOUT_S`` | session_call_timeout_s | 900 |
| ``TALLY_RAY_CALL_TIMEOUT_S`` | ray_call_timeout_s | 30 |
| ``TALLY_SESSIONS_ADVERTISE_HOST`` | sessions_advertise_host | none: the Ray node IP |
"""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


class Settings(BaseModel):
    """Where the controller keeps its state and how it reaches Ray."""

    model_config = ConfigDict(frozen=True)

    data_dir: Path = Field(default_factory=lambda: Path.home() / ".tally")
    """Database, job folders and logs live here."""
    database_url: str | None = None
    """Any SQLAlchemy URL; None: a SQLite file in the data folder (WAL mode)."""
    ray_address: str | None = None
    """Ray dashboard (job server) URL, e.g. http://127.0.0.1:8265; None: start a local head."""
    api_token: str | None = None
    """Bearer token required by mutating endpoints; None: no auth (loopback only)."""
    host: str = "127.0.0.1"
    """Address uvicorn binds."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port uvicorn binds."""
    public_url: str | None = None
    """URL jobs use to reach the controller; None: http://127.0.0.1:<port>."""
    allowed_roots: tuple[Path, ...] = ()
    """Folders (besides the data folder) that job config paths may point into."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names served besides loopback, the bind address and the public URL's host
    (DNS-rebinding guard); ``*``: any."""
    max_request_bytes: int = Field(default=1 << 20, gt=0)
    """``server.max_request_bytes``: larger request bodies get a 413 naming it (the
    training client splits a forward_backward call to fit)."""
    max_running_jobs: int = Field(default=2, gt=0)
    """Jobs submitted to Ray at once; the rest wait in status 'queued'."""
    ray_num_cpus: int = Field(default=4, gt=0)
    """CPUs of the local Ray head the controller starts (when no ray_address)."""
    reconcile_interval_s: float = Field(default=1.0, gt=0)
    """Seconds between two passes of the status reconcile loop."""
    python: str = sys.executable
    """Interpreter of job entrypoints (the controller's venv)."""
    max_sessions: int = Field(default=4, gt=0)
    """Training sessions (services/sessions) live at once; another is refused with 429."""
    session_idle_timeout_s: float = Field(default=1800.0, gt=0)
    """A session without a call for this long saves its state and ends."""
    session_start_timeout_s: float = Field(default=300.0, gt=0)
    """Longest a call waits for a starting session (its gang placed, its model loaded)."""
    session_call_timeout_s: float = Field(default=900.0, gt=0)
    """Longest one forwarded session call (forward_backward, save, …) may take; then 504."""
    ray_call_timeout_s: float = Field(default=30.0, gt=0)
    """Longest one call to the Ray job server (or its state API) may take."""
    sessions_advertise_host: str | None = None
    """Address a session's server gives the controller; None: its Ray node's IP."""

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'controller.db'}"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    @property
    def sessions_dir(self) -> Path:
        return self.data_dir / "sessions"

    @property
    def controller_url(self) -> str:
        return (self.public_url or f"http://127.0.0.1:{self.port}").rstrip("/")

    @property
    def roots(self) -> tuple[Path, ...]:
        """Resolved folders that config paths may point into."""
        return tuple(p.expanduser().resolve() for p in (self.data_dir, *self.allowed_roots))

    def inside_roots(self, path: str | Path) -> bool:
        """Whether the controller may read or write ``path`` (a registered job's folder
        may name anything)."""
        resolved = Path(path).expanduser().resolve()
        return any(resolved.is_relative_to(root) for root in self.roots)

    @property
    def max_body_bytes(self) -> int:
        """The old name of :attr:`max_request_bytes`."""
        return self.max_request_bytes

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Settings from ``TALLY_*`` variables; keyword arguments win."""
        env = os.environ
        values: dict[str, object] = {}
        simple = {"TALLY_DATA_DIR": "data_dir", "TALLY_DATABASE_URL": "database_url",
                  "TALLY_RAY_ADDRESS": "ray_address", "TALLY_API_TOKEN": "api_token",
                  "TALLY_PUBLIC_URL": "public_url",
                  "TALLY_MAX_BODY_BYTES": "max_request_bytes",  # the old name: an alias
                  "TALLY_MAX_REQUEST_BYTES": "max_request_bytes",  # after it: it wins
                  "TALLY_MAX_RUNNING_JOBS": "max_running_jobs",
                  "TALLY_RAY_NUM_CPUS": "ray_num_cpus", "TALLY_MAX_SESSIONS": "max_sessions",
                  "TALLY_SESSION_IDLE_TIMEOUT_S": "session_idle_timeout_s",
                  "TALLY_SESSION_START_TIMEOUT_S": "session_start_timeout_s",
                  "TALLY_SESSION_CALL_TIMEOUT_S": "session_call_timeout_s",
                  "TALLY_RAY_CALL_TIMEOUT_S": "ray_call_timeout_s",
                  "TALLY_SESSIONS_ADVERTISE_HOST": "sessions_advertise_host"}
        for var, field in simple.items():
            if env.get(var):
                values[field] = env[var]
        if env.get("TALLY_ALLOWED_HOSTS"):
            values["allowed_hosts"] = tuple(h.strip() for h in
                                            env["TALLY_ALLOWED_HOSTS"].split(",") if h.strip())
        if env.get("TALLY_ALLOWED_ROOTS"):
            values["allowed_roots"] = tuple(Path(p) for p in
                                            env["TALLY_ALLOWED_ROOTS"].split(os.pathsep) if p)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(settings: Settings) -> None:
    """Refuse to listen beyond loopback without a token (raises ValueError)."""
    if not is_loopback(settings.host) and not settings.api_token:
        raise ValueError(f"refusing to bind {settings.host}: a non-loopback address needs "
                         "TALLY_API_TOKEN (mutating endpoints would be open to the network)")
