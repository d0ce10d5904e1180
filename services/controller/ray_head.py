"""A local Ray head for the controller's embedded default (and for tests).

``ray start --head --block`` in its own session, from the controller's venv, with its job
server (dashboard) on 127.0.0.1 and every fixed port chosen free, in a short temp folder
of its own (so ``ray.init(address="auto")`` elsewhere never finds it). Stopping kills that
process tree only: never ``ray stop``, which would end every Ray cluster of the machine.
"""

from __future__ import annotations

import contextlib
import os
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

QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TRANSFORMERS_VERBOSITY": "error",
             "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


class LocalRayHead:
    """One Ray head on this machine; ``address`` is its job server URL."""

    def __init__(self, num_cpus: int = 4, log_path: Path | None = None) -> None:
        self.num_cpus = num_cpus
        self.log_path = log_path
        self.temp_dir = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self, timeout_s: float = 120.0, attempts: int = 2) -> str:
        """Start the head (a second try with fresh ports if the first one dies)."""
        enable_ray_token_auth()
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> str:
        self.temp_dir = tempfile.mkdtemp(prefix="tally-ray-")
        dashboard_port = free_port()
        ray_bin = Path(sys.executable).parent / "ray"
        command = [
            str(ray_bin) if ray_bin.exists() else "ray", "start", "--head", "--block",
            f"--port={free_port()}", f"--num-cpus={self.num_cpus}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
        ]
        env = {**os.environ, **QUIET_ENV,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("RAY_ADDRESS", None)
        log = (self.log_path.open("ab") if self.log_path
               else open(os.devnull, "wb"))  # noqa: SIM115 - handed to the child
        with log:
            self.process = subprocess.Popen(command, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.address = f"http://127.0.0.1:{dashboard_port}"
        deadline = time.monotonic() + timeout_s
        while not dashboard_up(self.address):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the local Ray head did not start (log: {self.log_path})")
            time.sleep(0.5)
        return self.address

    def stop(self) -> None:
        """Kill the head's process tree (the job drivers and actors included)."""
        if self.process is None:
            return
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)
        self.process.wait(timeout=10)
        self.process = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)
