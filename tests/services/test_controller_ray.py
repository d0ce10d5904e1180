"""The controller for real: a `tally serve` process, a local Ray head (loopback job server),
a SQLite file, and tiny demo jobs. Submit (JSON and YAML), logs, cancel, a sweep of the
four modes, and a controller restart in the middle of a job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.controller.ray_head import LocalRayHead, free_port
from tests.services.controller_fakes import (
    DEMO,
    DEMO_OVERRIDES,
    ROOT,
)

MODES = ["sample_mean", "token_mean", "prompt_mean", "constant"]

pytestmark = pytest.mark.slow


class ControllerProcess:
    """``python -m services.controller`` on a fixed port, restartable."""

    def __init__(self, data_dir: Path, ray_address: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir.parent / "controller.log"
        self.env = {**os.environ, "TALLY_DATA_DIR": str(data_dir),
                    "TALLY_RAY_ADDRESS": ray_address, "TALLY_MAX_RUNNING_JOBS": "2",
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("TALLY_API_TOKEN", None)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.controller", "--port", str(self.port),
                 "--log-level", "warning"], cwd=ROOT, env=self.env, stdout=log,
                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "controller did not start"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


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
    proc.start()
    yield proc
    proc.stop()


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


def test_submit_json_and_restart_the_controller_mid_job(controller: ControllerProcess,
                                                        ray_head: LocalRayHead) -> None:
    """The controller is down from the job's start to its end: the restarted one re-attaches
    to the Ray job, back-fills the metrics the driver could not send, and saves its logs."""
    response = httpx.post(f"{controller.url}/api/jobs",
                          json={"config_yaml": DEMO, "overrides": DEMO_OVERRIDES})
    assert response.status_code == 201, response.text
    job = wait_job(controller.url, response.json()["id"], ("pending", "running"))
    controller.stop()
    client = ray_client(ray_head)
    deadline = time.monotonic() + 180
    while not client.get_job_status(job["ray_submission_id"]).is_terminal():
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.5)
    controller.start()
    done = wait_job(controller.url, job["id"], ("succeeded",), timeout_s=60)
    assert done["last_step"] == 1 and done["ray_submission_id"] == f"tally-{job['id']}"
    metrics = httpx.get(f"{controller.url}/api/jobs/{job['id']}/metrics",
                        params={"names": [f"pg_loss/{m}" for m in MODES]}).json()
    assert metrics["steps"] == [0, 1]
    assert all(v is not None for series in metrics["series"].values() for v in series)
    assert "step 2/2" in httpx.get(f"{controller.url}/api/jobs/{job['id']}/logs").text
    assert "step 2/2" in (Path(job["output_dir"]) / "driver.log").read_text()
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


def test_sweep_and_a_ray_job_submit_job(controller: ControllerProcess,
                                        ray_head: LocalRayHead) -> None:
    """A sweep completes with per-mode metrics; meanwhile a job submitted straight to Ray
    (``ray job submit`` style) registers itself and is tracked like the others. (Two
    modes here: the README's four-mode sweep on real Ray is test_controller_gang's.)"""
    modes = ["token_mean", "constant"]
    response = httpx.post(f"{controller.url}/api/sweeps", json={
        "config_yaml": DEMO, "overrides": DEMO_OVERRIDES, "modes": modes})
    assert response.status_code == 201, response.text
    sweep = response.json()
    data_dir = Path(controller.env["TALLY_DATA_DIR"])
    sets = " ".join(f"--set {o}" for o in [*DEMO_OVERRIDES, "name=outside"])
    submission = ray_client(ray_head).submit_job(
        entrypoint=f"{sys.executable} -m services.train {ROOT / 'configs' / 'demo.yaml'} "
                   f"{sets} --output-dir {data_dir / 'jobs' / 'outside'}",
        runtime_env={"env_vars": {"TALLY_CONTROLLER_URL": controller.url,
                                  "TALLY_DATA_DIR": str(data_dir)}})
    for job in sweep["jobs"]:
        wait_job(controller.url, job["id"], ("succeeded",), timeout_s=240)
    assert httpx.get(f"{controller.url}/api/sweeps/{sweep['id']}").json()["status"] == \
        "succeeded"
    runs = httpx.get(f"{controller.url}/api/sweeps/{sweep['id']}/metrics").json()["runs"]
    assert [r["label"] for r in runs] == modes and [r["mode"] for r in runs] == modes
    for run in runs:
        assert run["steps"] == [0, 1] and None not in run["series"]["pg_loss"]
        assert None not in run["series"][f"pg_loss/{run['mode']}"]
    deadline = time.monotonic() + 120
    while not (found := httpx.get(f"{controller.url}/api/jobs",
                                  params={"name": "outside"}).json()["items"]):
        assert time.monotonic() < deadline, "the ray job submit job never registered"
        time.sleep(0.5)
    outside = found[0]
    assert outside["source"] == "registered"
    done = wait_job(controller.url, outside["id"], ("succeeded",))
    assert done["last_step"] == 1
    while httpx.get(f"{controller.url}/api/jobs/{outside['id']}").json()[
            "ray_submission_id"] != submission:
        assert time.monotonic() < deadline, "its Ray submission was never found"
        time.sleep(0.5)
    assert "step 2/2" in httpx.get(f"{controller.url}/api/jobs/{outside['id']}/logs").text


def test_embedded_head_starts_with_the_controller_and_stops_with_it(tmp_path: Path) -> None:
    from services.controller.ray_head import dashboard_up

    proc = ControllerProcess(tmp_path / "data", "")
    proc.env.pop("TALLY_RAY_ADDRESS")
    proc.start()
    try:
        ray = httpx.get(f"{proc.url}/healthz").json()["ray"]
        assert ray.startswith("http://127.0.0.1:") and dashboard_up(ray)
    finally:
        proc.stop()
    assert not dashboard_up(ray)
    assert "tally-ray-" not in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                              text=True).stdout
