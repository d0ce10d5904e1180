"""The gang: the one place Ray is started and a program's actors are started and stopped.

    ensure_ray ─► Gang(config, roles) ─► reserve_job (one placement group, job_bundles)
                  ─► engines · teachers · reward actors · manager · trainer · critic
                  ─► run(gang) ─► close()  (stops exactly what it started, alive or dead)
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import ray

from services.runtime.quiet import QUIET_ENV


def ensure_ray(num_cpus: int) -> bool:
    """Join the cluster named by RAY_ADDRESS (set by ``ray job submit``, or by a user of
    ``ray start --head``), else start a local head; True if we started it.

    We never guess with ``address="auto"``: a stale local cluster would hang the job. On a
    cluster we do not own, the job's runtime env is left alone; our actors set theirs.
    """
    if ray.is_initialized():
        return False
    os.environ.update({k: v for k, v in QUIET_ENV.items() if k not in os.environ})
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        _stop_quietly_on_sigterm()
        return False
    _drop_token_auth_notice()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": dict(QUIET_ENV)}, logging_level="WARNING")
    _stop_quietly_on_sigterm()
    return True


def _stop_quietly_on_sigterm() -> None:
    """A cancelled job (the controller's stop, ``ray job stop``) ends with one line, not
    the ``*** SIGTERM received … PC: @ 0x7f…`` stack dump of the handler ``ray.init``
    installs (so this one goes in after it); the exit still unwinds, so the ``finally``
    blocks stop what the job started. Only the main thread may set a handler."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stopped(signum: int, _frame: object) -> None:
        print("stopped: SIGTERM (the job was cancelled or its Ray job stopped)", flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)


TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"
"""How Ray (2.60 here) starts the WARNING it logs whenever ``ray.init`` starts a cluster with
``RAY_AUTH_MODE`` unset."""


class _TokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TOKEN_AUTH_NOTICE)


def _drop_token_auth_notice() -> None:
    """Drop Ray's "Token authentication is enabled for this Ray cluster" notice, printed
    on every run. Only the notice goes: the head still gets token auth exactly as Ray sets
    it up (RAY_AUTH_MODE=token for it and its children, ~/.ray/auth_token created if
    missing), and an explicit RAY_AUTH_MODE is left alone (then Ray says nothing anyway);
    its warning that auth is *disabled* still shows. Setting RAY_AUTH_MODE=token ourselves
    would silence it too, but Ray has read the mode into its cached config at import: this
    process stays "disabled" and makes no token, while the GCS it starts inherits "token"
    and never comes up (tried on Ray 2.60)."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _TokenAuthNotice) for f in logger.filters):
        logger.addFilter(_TokenAuthNotice())
