"""The controller for real: a `tally serve` process, a local Ray head (loopback job server),
a SQLite file, and tiny demo jobs. Submit (JSON and YAML), logs, cancel, a job submitted
straight to Ray that registers itself, a controller restart in the middle of a job, and
Ray's own answer for a job it never had; the README's ``ray job submit`` command on a
token-authenticated head; a training session created the moment the controller says it
is ready, and its secret kept out of Ray's job list and the database. (The four-mode
sweep on real Ray is test_controller_gang's; the embedded head's start and stop,
test_controller_restart's.)"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.clients.training import TrainingClient
from services.controller.ray_head import LocalRayHead
from services.controller.ray_jobs import RayJobBackend
from services.controller.session_secret import KEY_FILE
from services.sessions.server import SECRET_FILE, read_state
from tests.services.controller.fakes import (
    DEMO,
    DEMO_OVERRIDES,
    ROOT,
    loopback_socket,
    port_of,
)

MODES = ["sample_mean", "token_mean", "prompt_mean", "constant"]

pytestmark = pytest.mark.slow


class ControllerProcess:
    """``python -m services.controller`` on a port of its own, restartable on that port.

    The port is bound here (127.0.0.1, port 0) and the bound socket handed to each
    controller process (``--fd``), which listens on it: no free-port race. While no
    controller runs, the port is held bound but not listening, so connections are refused
    as by a controller that is down; it is bound again the moment the process is gone
    (the one instant the port is not held: a stranger would have to bind that very port
    then; the OS never hands a held port to a bind on port 0)."""

    def __init__(self, data_dir: Path, ray_address: str) -> None:
        self.sock: socket.socket | None = loopback_socket(rebindable=True)
        self.port = port_of(self.sock)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir.parent / "controller.log"
        self.env = {**os.environ, "TALLY_DATA_DIR": str(data_dir),
                    "TALLY_RAY_ADDRESS": ray_address, "TALLY_MAX_RUNNING_JOBS": "2",
                    "RAY_USAGE_STATS_ENABLED": "0",
                    # sessions on this machine's loopback (the Ray node IP is eth0's)
                    "TALLY_SESSIONS_ADVERTISE_HOST": "127.0.0.1"}
        self.env.pop("TALLY_API_TOKEN", None)
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_at = 0.0

    def start(self) -> None:
        """Start it and return once it printed "Tally controller ready at <url>" (its
        /readyz said ready); ``ready_at`` is when the line was seen."""
        assert self.sock is not None and self.process is None
        fd = self.sock.fileno()
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.controller", "--fd", str(fd),
                 "--log-level", "warning"], cwd=ROOT, env=self.env, stdout=log,
                stderr=subprocess.STDOUT, pass_fds=(fd,))
        self.sock.close()  # the controller's now: it goes with the process
        self.sock = None
        deadline = time.monotonic() + 120  # a guard: start-up is polled, not timed
        ready = f"Tally controller ready at {self.url}"
        while True:
            with self.log.open("rb") as log:
                log.seek(offset)
                if ready.encode() in log.read():
                    self.ready_at = time.monotonic()
                    return
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "controller did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (its shutdown runs), then hold the port again."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._gone()

    def kill(self) -> None:
        """SIGKILL: no shutdown at all (what it started lives on), then hold the port."""
        assert self.process is not None
        self.process.kill()
        self._gone()

    def _gone(self) -> None:
        if self.process is not None:
            self.process.wait()
        self.process = None
        if self.sock is None:  # at once: the port was free only since the process ended
            self.sock = loopback_socket(self.port, rebindable=True)

    def close(self) -> None:
        self.stop()
        if self.sock is not None:
            self.sock.close()
            self.sock = None


@contextlib.contextmanager
def controller_on_own_head(tmp_path_factory: pytest.TempPathFactory, num_cpus: int,
                           env: dict[str, str | None]) -> Iterator[ControllerProcess]:
    """A Ray head of ``num_cpus`` and a controller on it with ``env`` (None: unset), both
    stopped after."""
    head = LocalRayHead(num_cpus=num_cpus,
                        log_path=tmp_path_factory.mktemp("ray") / "head.log")
    head.start()
    proc = ControllerProcess(tmp_path_factory.mktemp("controller") / "data", head.address)
    for name, value in env.items():
        if value is None:
            proc.env.pop(name, None)
        else:
            proc.env[name] = value
    try:
        proc.start()
        yield proc
    finally:
        proc.close()
        head.stop()


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    head = LocalRayHead(num_cpus=6, log_path=tmp_path_factory.mktemp("ray") / "head.log")
    head.start()
    yield head
    head.stop()


@pytest.fixture(scope="module")
def controller(ray_head: LocalRayHead, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ControllerProcess]:
    proc = ControllerProcess(tmp_path_factory.mktemp("controller") / "data", ray_head.address)
    try:
        proc.start()
        yield proc
    finally:
        proc.close()


def wait_job(url: str, job_id: str, until: tuple[str, ...], timeout_s: float = 180,
             min_step: int | None = None) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = httpx.get(f"{url}/api/jobs/{job_id}", timeout=10).json()
        if job["status"] in until and (min_step is None or (job["last_step"] or -1) >= min_step):
            return job
        assert job["status"] not in ("failed", "cancelled") or job["status"] in until, job
        assert time.monotonic() < deadline, f"job {job_id} still {job['status']}"
        time.sleep(0.5)


def ray_client(ray_head: LocalRayHead):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(ray_head.address)


def test_a_session_made_right_after_ready_runs_and_its_secret_is_nowhere_readable(
        controller: ControllerProcess, ray_head: LocalRayHead) -> None:
    """First in the module: the controller printed that it is ready just now. A session
    created at once starts and answers (no 503 while the head's nodes have not reported
    yet); its secret is nowhere a stranger could read it: not in Ray's job list (what the
    dashboard shows: every job's ``runtime_env`` and metadata, from the real job server),
    not in the controller's database files, not left in the session's folder."""
    asked_after = time.monotonic() - controller.ready_at
    created = httpx.post(f"{controller.url}/api/sessions", timeout=60,
                         json={"config": {"rollout": {"model": "tiny"}}})
    assert asked_after < 1.0
    assert created.status_code == 201, created.text
    info = created.json()
    client = TrainingClient(controller.url)
    try:
        sampled = client.session(info["id"]).sample([[1, 2, 3]], max_new_tokens=2).result()
        assert len(sampled["sequences"][0][0]["tokens"]) == 2

        data_dir = Path(controller.env["TALLY_DATA_DIR"])
        key_file = data_dir / KEY_FILE
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        secret = hmac.new(bytes.fromhex(key_file.read_text()),
                          f"session-server:{info['id']}".encode(), hashlib.sha256).hexdigest()
        folder = Path(info["output_dir"])
        state = read_state(folder)
        assert state is not None and state["host"] == "127.0.0.1"  # as advertised
        server = f"http://{state['host']}:{state['port']}"
        # the secret is the one the session's server takes (so the greps below mean it)
        assert httpx.get(f"{server}/state", timeout=10).status_code == 401
        assert httpx.get(f"{server}/state", timeout=10, headers={
            "authorization": f"Bearer {secret}"}).status_code == 200
        assert not (folder / SECRET_FILE).exists()

        jobs = ray_client(ray_head).list_jobs()
        (mine,) = [j for j in jobs if j.submission_id == f"tally-session-{info['id']}"]
        assert "TALLY_SESSION_IDLE_TIMEOUT_S" in str(mine.runtime_env)  # its env is listed
        for job in jobs:
            assert secret not in f"{job.runtime_env} {job.metadata} {job.entrypoint}"

        database = [p for p in data_dir.glob("controller.db*") if p.is_file()]
        assert data_dir / "controller.db" in database
        for path in database:  # the WAL and shared-memory files too
            assert secret.encode() not in path.read_bytes(), path.name
    finally:
        httpx.delete(f"{controller.url}/api/sessions/{info['id']}", timeout=60)
        client.close()


def test_submit_json_and_restart_the_controller_mid_job(controller: ControllerProcess,
                                                        ray_head: LocalRayHead) -> None:
    """The controller is down from the job's start to its end: the restarted one re-attaches
    to the Ray job, back-fills the metrics the driver could not send, and saves its logs."""
    response = httpx.post(f"{controller.url}/api/jobs",
                          json={"config_yaml": DEMO, "overrides": DEMO_OVERRIDES})
    assert response.status_code == 201, response.text
    job = wait_job(controller.url, response.json()["id"], ("pending", "running"))
    controller.stop()
    try:
        client = ray_client(ray_head)
        deadline = time.monotonic() + 300
        while not client.get_job_status(job["ray_submission_id"]).is_terminal():
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(0.5)
    finally:  # the module's controller is up again for the next tests, whatever happened
        controller.start()
    done = wait_job(controller.url, job["id"], ("succeeded",), timeout_s=60)
    assert done["last_step"] == 1 and done["ray_submission_id"] == f"tally-{job['id']}"
    metrics = httpx.get(f"{controller.url}/api/jobs/{job['id']}/metrics",
                        params={"names": [f"pg_loss/{m}" for m in MODES]}).json()
    assert metrics["steps"] == [0, 1]
    assert all(v is not None for series in metrics["series"].values() for v in series)
    assert "(2/2 done)" in httpx.get(f"{controller.url}/api/jobs/{job['id']}/logs").text
    saved = Path(controller.env["TALLY_DATA_DIR"]) / "logs" / f"{job['id']}.log"
    assert "(2/2 done)" in saved.read_text()  # the controller's own copy, not the job's
    listed = httpx.get(f"{controller.url}/api/jobs", params={"status": "succeeded"}).json()
    assert job["id"] in [j["id"] for j in listed["items"]]


def test_yaml_submit_then_cancel_stops_the_job_and_its_actors(
        controller: ControllerProcess, ray_head: LocalRayHead) -> None:
    from ray.util.state import list_actors

    overrides = [o for o in DEMO_OVERRIDES if not o.startswith("num_steps")] + ["num_steps=5000"]
    response = httpx.post(f"{controller.url}/api/jobs", params={"set": overrides},
                          content=DEMO, headers={"Content-Type": "application/yaml"})
    assert response.status_code == 201, response.text
    job = wait_job(controller.url, response.json()["id"], ("running",))
    client = ray_client(ray_head)
    deadline = time.monotonic() + 120

    def alive_actors() -> list:
        ray_job_id = client.get_job_info(job["ray_submission_id"]).job_id
        return list_actors(address=ray_head.address, filters=[
            ("job_id", "=", ray_job_id), ("state", "=", "ALIVE")]) if ray_job_id else []

    while len(alive_actors()) < 2:  # the rollout manager and the trainer/engine actors
        assert time.monotonic() < deadline, "the job started no actors"
        time.sleep(0.5)
    cancelled = httpx.post(f"{controller.url}/api/jobs/{job['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    from ray.job_submission import JobStatus

    while client.get_job_status(job["ray_submission_id"]) != JobStatus.STOPPED or alive_actors():
        assert time.monotonic() < deadline, "the job or its actors outlived the cancel"
        time.sleep(0.5)


def test_the_readme_ray_job_submit_runs_the_demo_registers_and_is_tracked(
        controller: ControllerProcess, ray_head: LocalRayHead, tmp_path: Path) -> None:
    """The README's ``ray job submit --working-dir . -- python -m services.train
    configs/demo.yaml``, Ray's own CLI against a real head under token authentication
    (the token Ray set up for this machine), the working directory uploaded by Ray: the
    job runs to its end, prints its progress, registers itself with the controller
    (``TALLY_CONTROLLER_URL``) and is tracked like the others — its steps, its end, its
    Ray submission, its logs."""
    import json

    data_dir = Path(controller.env["TALLY_DATA_DIR"])
    assert os.environ.get("RAY_AUTH_MODE") == "token"  # the head asks for the token
    runtime_env = {"env_vars": {"TALLY_CONTROLLER_URL": controller.url,
                                "TALLY_DATA_DIR": str(data_dir)}}
    command = [str(Path(sys.executable).parent / "ray"), "job", "submit",
               "--address", ray_head.address, "--working-dir", str(ROOT),
               "--runtime-env-json", json.dumps(runtime_env), "--",
               "python", "-m", "services.train", "configs/demo.yaml",
               *[arg for o in [*DEMO_OVERRIDES, "name=outside"] for arg in ("--set", o)],
               "--output-dir", str(tmp_path / "outside")]
    deadline = time.monotonic() + 300  # a guard, polled for the agent to take the job
    while True:  # the dashboard answers before its job agent is ready: submit again
        result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                env={k: v for k, v in os.environ.items()
                                     if k != "RAY_ADDRESS"})
        if "No available agent to submit job" not in result.stderr + result.stdout:
            break
        assert time.monotonic() < deadline, "the head's job agent never came up"
        time.sleep(2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(2/2 done)" in result.stdout and "succeeded" in result.stdout.lower()
    rows = (tmp_path / "outside" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [0, 1]
    (outside,) = httpx.get(f"{controller.url}/api/jobs", params={"name": "outside"}
                           ).json()["items"]
    assert outside["source"] == "registered"
    done = wait_job(controller.url, outside["id"], ("succeeded",), timeout_s=300)
    assert done["last_step"] == 1
    while not (submission := httpx.get(f"{controller.url}/api/jobs/{outside['id']}"
                                       ).json()["ray_submission_id"]):
        assert time.monotonic() < deadline, "its Ray submission was never found"
        time.sleep(0.5)
    assert f"'{submission}'" in result.stdout  # the CLI's own submission
    assert "(2/2 done)" in httpx.get(f"{controller.url}/api/jobs/{outside['id']}/logs").text


def test_ray_answers_not_found_for_a_job_it_never_had(ray_head: LocalRayHead) -> None:
    """RayJobBackend tells "Ray has no such job" (None / False) from a job Ray has, on
    Ray's real job server and in its own words (not the fake's)."""
    backend = RayJobBackend(ray_head.address)
    never = "tally-never-submitted"
    assert backend.info(never) is None
    assert backend.logs(never) is None
    assert backend.stop(never) is False
    known = backend.submit("tally-not-found-contrast", f"{sys.executable} -c \"print('hi')\"",
                           {}, {})
    deadline = time.monotonic() + 300
    while (info := backend.info(known)).status not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, f"the contrast job is still {info.status}"
        time.sleep(0.5)
    assert info.status == "succeeded" and "hi" in (backend.logs(known) or "")
    assert backend.stop(known) is False  # known, but over: nothing to stop
