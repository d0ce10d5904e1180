"""A local Ray head for the controller's embedded default (and for tests).

``ray start --head --block`` in its own session, from the controller's venv, on 127.0.0.1
(node address and job server, i.e. the dashboard), in a short temp folder of its own (so
``ray.init(address="auto")`` elsewhere never finds it). Ray binds its ports itself where it
can (``0``: the GCS, the dashboard, its agent; the job server's address is then read back
from the dashboard's log in that folder), so no port is probed free and taken later by
someone else; only the Ray Client server's port, which Ray refuses as 0, is chosen free
(if another process takes it first, that head dies and a second try starts with a fresh
one). Stopping kills that process tree, and any process still naming its temp folder,
only: never ``ray stop``, which would end every Ray cluster of the machine.

Its environment is the controller's scrubbed to an allowlist (services/controller/job_env):
every job, actor and session inherits it, so the controller's API token, database URL and
key file path never reach them.

With a ``marker`` file (the controller's ``<data>/ray-head.json``) the head outlives a
controller killed without its shutdown (``kill -9``): the next controller re-adopts it,
and its jobs run on; a head that is gone (its ``ray start`` process dead or its job server
silent) is cleaned up (every process of its temp folder killed) and a fresh one started.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from services.controller.job_env import scrubbed_env
from services.runtime.forked_workers import forking_on, head_env
from services.runtime.quiet import HEAD_ENV, QUIET_ENV

TEMP_PREFIX = "tally-ray-"
DASHBOARD_LINE = re.compile(r"Dashboard head http address: (\S+)")
"""What Ray's dashboard logs once it listens (``http_server_head.py``)."""


QUIET_PORTS = range(20000, 32768)
"""Ports nobody hands out by themselves: above Ray's worker ports (10002–19999) and below
Linux's ephemeral range (32768–60999, where every ``bind(0)`` lands: a port probed free
there was taken by the head's own GCS or agent often enough to kill a test's head)."""


def free_port() -> int:
    """A port free right now, from QUIET_PORTS: another process may still take it before
    it is used. Only for a port a program refuses to pick itself (Ray's client server);
    else bind port 0."""
    for port in random.SystemRandom().sample(QUIET_PORTS, 64):  # no seed shared
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {QUIET_PORTS.start}–{QUIET_PORTS.stop - 1}")


def dashboard_address(temp_dir: str | Path) -> str:
    """The job server URL of the head of ``temp_dir``, from its dashboard's log (the port
    Ray picked); "" until the dashboard listens."""
    log = Path(temp_dir) / "session_latest" / "logs" / "dashboard.log"
    try:
        found = DASHBOARD_LINE.search(log.read_text(errors="replace"))
    except OSError:
        return ""
    return f"http://{found.group(1)}" if found else ""


def enable_ray_token_auth() -> None:
    """Use Ray's token auth for a cluster we start, as ``ray.init()`` does by default
    (keeps an explicit RAY_AUTH_MODE; generates ~/.ray/auth_token when missing)."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            enable_token_auth_by_default,
            ensure_token_if_auth_enabled,
        )
    except ImportError:  # a Ray without token auth
        return
    enable_token_auth_by_default()
    ensure_token_if_auth_enabled()


def dashboard_up(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/api/version", timeout=2).close()
        return True
    except urllib.error.HTTPError:  # answered (e.g. 401 under token auth): it is up
        return True
    except OSError:
        return False


def processes_of(temp_dir: str) -> list[Any]:
    """Every live process whose command line names ``temp_dir``, and their descendants
    (the head's own and its orphans: GCS, raylet, its agents and workers, the dashboard)."""
    import psutil

    if TEMP_PREFIX not in Path(temp_dir).name:  # never a pattern that could match others
        return []
    found: dict[int, Any] = {}
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                found[proc.pid] = proc
                found.update((child.pid, child) for child in proc.children(recursive=True))
    return list(found.values())


def kill_all(procs: list[Any]) -> None:
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)


class LocalRayHead:
    """One Ray head on this machine; ``address`` is its job server URL."""

    def __init__(self, num_cpus: int = 4, log_path: Path | None = None,
                 marker: Path | None = None) -> None:
        self.num_cpus = num_cpus
        self.log_path = log_path
        self.marker = marker
        self.temp_dir = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        """The ``ray start`` process (ours, or the one an earlier controller started)."""
        self.address = ""
        self.adopted = False

    def start(self, timeout_s: float = 120.0, attempts: int = 2) -> str:
        """Re-adopt the head of the marker, else start one (a second try with fresh ports
        if the first one dies)."""
        enable_ray_token_auth()
        if self.adopt():
            return self.address
        for attempt in range(attempts):
            try:
                address = self._start_once(timeout_s)
                self._write_marker()
                return address
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def adopt(self) -> bool:
        """The marker's head, if it still runs; else clean up what is left of it."""
        import psutil

        if self.marker is None or not self.marker.is_file():
            return False
        try:
            record = json.loads(self.marker.read_text())
            pid, address, temp_dir = int(record["pid"]), str(record["address"]), \
                str(record["temp_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            self.marker.unlink(missing_ok=True)
            return False
        try:
            alive = temp_dir in " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            alive = False
        if alive and dashboard_up(address):
            self.pid, self.address, self.temp_dir, self.adopted = pid, address, temp_dir, True
            return True
        kill_all(processes_of(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)
        self.marker.unlink(missing_ok=True)
        return False

    def _write_marker(self) -> None:
        if self.marker is None:
            return
        staging = self.marker.with_suffix(".tmp")
        staging.write_text(json.dumps({"pid": self.pid, "address": self.address,
                                       "temp_dir": self.temp_dir}))
        os.replace(staging, self.marker)

    def _start_once(self, timeout_s: float) -> str:
        self.temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
        command = [  # Ray's ``ray start``, its workers forked (services/runtime/ray_start)
            sys.executable, "-m", "services.runtime.ray_start", "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", "--port=0", f"--num-cpus={self.num_cpus}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--dashboard-port=0",
            "--dashboard-agent-listen-port=0",
            f"--ray-client-server-port={free_port()}",  # Ray accepts no 0 here (1024-65535)
            f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
        ]
        # scrubbed: every job, actor and session inherits this (services/controller/job_env)
        env = {**scrubbed_env(os.environ), **QUIET_ENV, **HEAD_ENV, **head_env(forking_on()),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        log = (self.log_path.open("ab") if self.log_path
               else open(os.devnull, "wb"))  # noqa: SIM115 - handed to the child
        with log:
            self.process = subprocess.Popen(command, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.process.pid
        self.address = ""
        deadline = time.monotonic() + timeout_s
        while not (self.address and dashboard_up(self.address)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the local Ray head did not start (log: {self.log_path})")
            time.sleep(0.5)
            self.address = self.address or dashboard_address(self.temp_dir)
        return self.address

    def stop(self) -> None:
        """Kill the head's process tree and every process left naming its temp folder (the
        job drivers and actors included)."""
        import psutil

        if self.pid is None:
            return
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        kill_all(procs)
        kill_all(processes_of(self.temp_dir))
        if self.process is not None:
            self.process.wait(timeout=10)
        self.process = self.pid = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)
