"""`tally serve` on its embedded Ray head (no TALLY_RAY_ADDRESS): the head starts with the
controller, on loopback. Killed with SIGKILL mid-job, the controller leaves the head and
the job running; the restarted one re-adopts the head (``<data>/ray-head.json``), the job
runs on and finishes with every step's metrics, and the final shutdown stops the head and
leaves no process of it, a training session on it saving its state first. A job server
that goes away after a client of it was made is ``BackendUnavailable``
(test_controller_ray_down.py: one that never answered)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import psutil
import pytest

from services.clients.training import TrainingClient, datum
from services.controller.ray_head import dashboard_up, enable_ray_token_auth, processes_of
from services.controller.ray_jobs import BackendUnavailable, RayJobBackend
from services.controller.store import Store
from tests.services.controller.fakes import DEMO_OVERRIDES
from tests.services.controller.test_ray import DEMO, ControllerProcess, wait_job

pytestmark = pytest.mark.slow
NUM_STEPS = 40  # long enough that the kill lands mid-job (it comes right after step 0)


def embedded(tmp_path: Path) -> ControllerProcess:
    proc = ControllerProcess(tmp_path / "data", "")
    proc.env.pop("TALLY_RAY_ADDRESS")
    proc.env["TALLY_RAY_NUM_CPUS"] = "2"
    return proc


def marker(proc: ControllerProcess) -> dict:
    return json.loads((Path(proc.env["TALLY_DATA_DIR"]) / "ray-head.json").read_text())


def last_step_written(output_dir: str) -> int:
    """The last step in the job's own metrics.jsonl (what the driver wrote, controller or
    not); -1 before the first."""
    path = Path(output_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    return max(steps, default=-1)


def test_kill_9_mid_job_then_restart_loses_nothing(tmp_path: Path) -> None:
    proc = embedded(tmp_path)
    try:
        proc.start()
        head = marker(proc)
        ray = httpx.get(f"{proc.url}/healthz").json()["ray"]
        assert ray == head["address"] and ray.startswith("http://127.0.0.1:")
        assert dashboard_up(ray)  # the embedded head, started with the controller
        overrides = [o for o in DEMO_OVERRIDES if not o.startswith("num_steps")]
        response = httpx.post(f"{proc.url}/api/jobs", json={
            "config_yaml": DEMO, "overrides": [*overrides, f"num_steps={NUM_STEPS}"]})
        assert response.status_code == 201, response.text
        job = wait_job(proc.url, response.json()["id"], ("running",), timeout_s=300,
                       min_step=0)
        assert job["last_step"] < NUM_STEPS - 2, "the job ended before the kill"
        proc.kill()
        at_kill = last_step_written(job["output_dir"])
        deadline = time.monotonic() + 300  # a guard: steps go on while no controller listens
        while last_step_written(job["output_dir"]) <= at_kill:
            assert time.monotonic() < deadline, "the job made no step without its controller"
            time.sleep(0.2)
        assert dashboard_up(head["address"])
        proc.start()
        assert marker(proc) == head  # re-adopted, not a new head
        assert httpx.get(f"{proc.url}/healthz").json()["ray"] == head["address"]
        done = wait_job(proc.url, job["id"], ("succeeded",), timeout_s=600)
        assert done["last_step"] == NUM_STEPS - 1
        metrics = httpx.get(f"{proc.url}/api/jobs/{job['id']}/metrics",
                            params={"names": "pg_loss"}).json()
        assert metrics["steps"] == list(range(NUM_STEPS))
        assert None not in metrics["series"]["pg_loss"]
        enable_ray_token_auth()  # as the controller does: the head has token auth on
        backend = RayJobBackend(head["address"])  # a client made while the server is up
        assert backend.info(job["ray_submission_id"]).status == "succeeded"
        session = TrainingClient(proc.url).create_session({"rollout": {"model": "tiny"}})
        session.forward_backward([datum([1, 2], [3, 4])]).result()
        assert session.optim_step(lr=1e-3).result()["step"] == 1
    finally:
        proc.close()
    # the head went with the controller: its session saved its state first
    row = Store(f"sqlite:///{proc.env['TALLY_DATA_DIR']}/controller.db").get_session(
        session.id)
    assert (row.status, row.step, row.error) == ("succeeded", 1, None)  # shown "ended"
    assert row.saved_path == str(Path(row.output_dir) / "saved" / "shutdown")
    assert (Path(row.saved_path) / "model.safetensors").is_file()
    assert processes_of(head["temp_dir"]) == []
    assert not psutil.pid_exists(head["pid"]) and not dashboard_up(head["address"])
    assert not (Path(proc.env["TALLY_DATA_DIR"]) / "ray-head.json").exists()
    with pytest.raises(BackendUnavailable, match=head["address"]):
        backend.info(job["ray_submission_id"])  # ... and gone now
