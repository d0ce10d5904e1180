"""The driver's ControllerSink: batched, retried, bounded, never blocking or raising into
training; self-registration; the succeeded / failed report of ``controller_sinks``."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from services.config import parse_job_config
from services.controller.app import create_app
from services.controller.ray_head import free_port
from services.controller_client import ControllerSink, controller_sinks
from tests.services.controller_fakes import FakeBackend, make_settings, serve_in_thread

METRICS = {"pg_loss": 0.25, "reward/mean": 0.5, "kl": float("nan")}


@pytest.fixture
def controller(tmp_path: Path):
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    with serve_in_thread(app) as url:
        yield url


def wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_registers_then_sends_every_step_in_batches(controller: str, tmp_path: Path) -> None:
    config = parse_job_config("name: outside\nnum_steps: 250\n")
    registration = {"config": config.model_dump(mode="json", exclude_unset=True),
                    "output_dir": str(tmp_path / "job")}
    sink = ControllerSink(controller, None, registration=registration, batch_size=64)
    for step in range(250):
        sink.write(step, METRICS)
    sink.close()
    sink.finish("succeeded")
    assert sink.job_id and sink.sent == 250 and sink.dropped == 0
    job = httpx.get(f"{controller}/api/jobs/{sink.job_id}").json()
    assert (job["source"], job["status"], job["last_step"]) == ("registered", "succeeded", 249)
    out = httpx.get(f"{controller}/api/jobs/{sink.job_id}/metrics").json()
    assert out["steps"] == list(range(250)) and out["series"]["kl"][0] is None


def test_a_dead_controller_never_blocks_or_raises() -> None:
    sink = ControllerSink(f"http://127.0.0.1:{free_port()}", "job", max_queue=100,
                          timeout_s=0.5)
    started = time.perf_counter()
    for step in range(1000):
        sink.write(step, METRICS)
    assert time.perf_counter() - started < 1.0  # 1000 writes, no network on this path
    sink.close(timeout_s=3.0)
    assert time.perf_counter() - started < 5.0
    assert len(sink.queue) <= 100 and sink.dropped >= 900
    sink.finish("failed", "boom")  # unreachable: logged, not raised


def test_retries_until_the_controller_comes_up(tmp_path: Path) -> None:
    port = free_port()
    app = create_app(make_settings(tmp_path, port=port), backend=FakeBackend())
    job_id = None
    sink = None
    try:
        sink = ControllerSink(f"http://127.0.0.1:{port}", None, timeout_s=1.0,
                              max_backoff_s=0.5, registration={
                                  "config": {"name": "late"}, "output_dir": str(tmp_path)})
        for step in range(5):
            sink.write(step, METRICS)
        time.sleep(1.0)  # a few failed tries
        assert sink.sent == 0
        with serve_in_thread(app, port=port) as url:
            wait_for(lambda: sink.sent == 5)
            job_id = sink.job_id
            steps = httpx.get(f"{url}/api/jobs/{job_id}/metrics").json()["steps"]
            assert steps == [0, 1, 2, 3, 4]
    finally:
        if sink is not None:
            sink.close(timeout_s=1.0)


def test_controller_sinks_reports_the_error_of_a_failed_run(
        controller: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = parse_job_config("name: crashing\nnum_steps: 3\n")
    monkeypatch.delenv("TALLY_CONTROLLER_URL", raising=False)
    with controller_sinks(config, tmp_path) as sinks:
        assert sinks == []
    monkeypatch.setenv("TALLY_CONTROLLER_URL", controller)
    monkeypatch.delenv("TALLY_JOB_ID", raising=False)
    with pytest.raises(RuntimeError, match="rank 0 died"), \
            controller_sinks(config, tmp_path) as sinks:
        sinks[0].write(0, METRICS)
        raise RuntimeError("rank 0 died")
    job = httpx.get(f"{controller}/api/jobs", params={"name": "crashing"}).json()["items"][0]
    detail = httpx.get(f"{controller}/api/jobs/{job['id']}").json()
    assert detail["status"] == "failed" and "RuntimeError: rank 0 died" in detail["error"]
    assert detail["last_step"] == 0 and detail["output_dir"] == str(tmp_path.resolve())
