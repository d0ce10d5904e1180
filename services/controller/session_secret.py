"""The secret a session's server takes from the controller, and how it gets there.

    secret = HMAC-SHA256(controller key, "session-server:" + session id)   (hex)

The controller key is 32 random bytes in ``<data dir>/session-key`` (mode 0600, made on
first use), or in ``$TALLY_CONTROLLER_DIR/session-key``: on KubeRay the data folder is the
volume every Ray pod mounts, with the same uid, so the key lives in a Secret mounted into
the controller pod only, at TALLY_CONTROLLER_DIR (docs/deploy.md). The controller
recomputes any session's secret after a restart, and neither the database nor Ray's job
metadata (the dashboard's job list shows every job's ``runtime_env``) holds it. The secret
reaches the session's process as a file in its folder (``.secret``, mode 0600, written
before the Ray job is submitted), which the server reads and removes as it starts
(services/sessions/server.py ``take_secret``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from functools import lru_cache
from pathlib import Path

from services.sessions.server import SECRET_FILE

KEY_FILE = "session-key"
CONTROLLER_DIR_ENV = "TALLY_CONTROLLER_DIR"
"""A folder of the controller's own that no job can read, holding the key when set (never
passed to a job: job_env.py)."""


def key_path(data_dir: Path) -> Path:
    """The controller key's file: in ``TALLY_CONTROLLER_DIR`` when set, else ``data_dir``."""
    own = os.environ.get(CONTROLLER_DIR_ENV)
    return (Path(own) if own else data_dir) / KEY_FILE


@lru_cache(maxsize=8)
def controller_key(data_dir: Path) -> bytes:
    """The key of ``data_dir``'s controller, created (0600) the first time (a mounted
    Secret is read-only: it is read, never made)."""
    path = key_path(data_dir)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_text().strip()
    else:
        key = secrets.token_hex(32)
        with os.fdopen(fd, "w") as out:
            out.write(key)
    if len(key) != 64:
        raise RuntimeError(f"{path}: not a controller key (64 hex digits); remove it to "
                           "make a new one (live sessions are then unreachable)")
    return bytes.fromhex(key)


def session_secret(data_dir: Path, session_id: str) -> str:
    """The bearer secret of session ``session_id``'s server (formula above)."""
    return hmac.new(controller_key(data_dir), f"session-server:{session_id}".encode(),
                    hashlib.sha256).hexdigest()


def hand_over(folder: Path, secret: str) -> None:
    """``<folder>/.secret``, readable by its owner only, for the session's server."""
    path = folder / SECRET_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret)
