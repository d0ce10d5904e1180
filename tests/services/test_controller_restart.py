"""`tally serve` killed with SIGKILL mid-job, on its embedded Ray head: the restarted
controller re-adopts the head (``<data>/ray-head.json``), the job runs on and finishes with
every step's metrics, and the final shutdown leaves no process of that head."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from services.controller.ray_head import dashboard_up, processes_of
from tests.services.controller_fakes import DEMO_OVERRIDES
from tests.services.test_controller_ray import DEMO, ControllerProcess, wait_job

pytestmark = pytest.mark.slow
NUM_STEPS = 40  # long enough that the kill lands mid-job on an idle machine


def embedded(tmp_path: Path) -> ControllerProcess:
    proc = ControllerProcess(tmp_path / "data", "")
    proc.env.pop("TALLY_RAY_ADDRESS")
    proc.env["TALLY_RAY_NUM_CPUS"] = "2"
    return proc


def kill9(proc: ControllerProcess) -> None:
    assert proc.process is not None
    proc.process.send_signal(signal.SIGKILL)
    proc.process.wait()
    proc.process = None


def marker(proc: ControllerProcess) -> dict:
    return json.loads((Path(proc.env["TALLY_DATA_DIR"]) / "ray-head.json").read_text())


def test_kill_9_mid_job_then_restart_loses_nothing(tmp_path: Path) -> None:
    proc = embedded(tmp_path)
    proc.start()
    try:
        head = marker(proc)
        overrides = [o for o in DEMO_OVERRIDES if not o.startswith("num_steps")]
        response = httpx.post(f"{proc.url}/api/jobs", json={
            "config_yaml": DEMO, "overrides": [*overrides, f"num_steps={NUM_STEPS}"]})
        assert response.status_code == 201, response.text
        job = wait_job(proc.url, response.json()["id"], ("running",), timeout_s=240,
                       min_step=0)
        assert job["last_step"] < NUM_STEPS - 2, "the job ended before the kill"
        kill9(proc)
        time.sleep(2)  # steps go on while no controller listens
        assert dashboard_up(head["address"])
        proc.start()
        assert marker(proc) == head  # re-adopted, not a new head
        assert httpx.get(f"{proc.url}/healthz").json()["ray"] == head["address"]
        done = wait_job(proc.url, job["id"], ("succeeded",), timeout_s=300)
        assert done["last_step"] == NUM_STEPS - 1
        metrics = httpx.get(f"{proc.url}/api/jobs/{job['id']}/metrics",
                            params={"names": "pg_loss"}).json()
        assert metrics["steps"] == list(range(NUM_STEPS))
        assert None not in metrics["series"]["pg_loss"]
    finally:
        proc.stop()
    assert processes_of(head["temp_dir"]) == []
    assert not psutil.pid_exists(head["pid"]) and not dashboard_up(head["address"])
    assert not (Path(proc.env["TALLY_DATA_DIR"]) / "ray-head.json").exists()
