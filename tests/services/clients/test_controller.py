"""The driver's ControllerSink: batched, retried, bounded, never blocking or raising into
training; self-registration; the succeeded / failed report of ``controller_sinks``."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import httpx
import pytest

from services.clients.controller import ControllerSink, controller_sinks
from services.config.job import parse_job_config
from services.controller.app import create_app
from tests.services.controller.fakes import (
    FakeBackend,
    loopback_socket,
    make_settings,
    port_of,
    refusing_url,
    serve_in_thread,
)

METRICS = {"pg_loss": 0.25, "reward/mean": 0.5, "kl": float("nan")}


@pytest.fixture
def controller(tmp_path: Path):
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    with serve_in_thread(app) as url:
        yield url


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    """Poll ``predicate``; the deadline is a guard against a hang, not a speed check."""
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


def still_open(conn: socket.socket) -> bool:
    """Whether the peer of ``conn`` still holds it open (what it sent is read and
    dropped): False once it closed its side."""
    conn.setblocking(False)
    try:
        while conn.recv(65536):
            pass
        return False
    except BlockingIOError:
        return True


def test_writes_never_wait_on_a_controller_that_hangs() -> None:
    """The sender is stuck in a request the controller accepted and never answers; 1000
    writes still return (they only queue: had one waited on the network, it would return
    only once the request timed out, and the request would be gone), the queue keeps its
    newest rows, and closing ends the thread once the request fails."""
    with loopback_socket() as listener:
        listener.listen(1)
        listener.settimeout(120)  # a guard only: the sink connects within a flush interval
        sink = ControllerSink(f"http://127.0.0.1:{port_of(listener)}", "job", batch_size=10,
                              max_queue=100, timeout_s=300)
        for step in range(10):
            sink.write(step, METRICS)  # a full batch: the sender wakes and posts it
        hung, _ = listener.accept()
        with hung:
            for step in range(10, 1010):
                sink.write(step, METRICS)
            assert still_open(hung) and sink.sent == 0  # the request is still unanswered
            assert len(sink.queue) == 100 and sink.dropped == 910
            assert [row["step"] for row in sink.queue] == list(range(910, 1010))
            listener.close()  # from now on the controller refuses
        sink.close(timeout_s=60)  # the hung request failed: the thread gives up and ends
        assert not sink._thread.is_alive()


def test_an_unreachable_controller_is_logged_never_raised() -> None:
    with refusing_url() as url:
        sink = ControllerSink(url, "job", timeout_s=1.0)
        sink.write(0, METRICS)
        sink.close(timeout_s=60)
        assert not sink._thread.is_alive() and sink.sent == 0
        sink.finish("failed", "boom")  # unreachable: logged, not raised


def test_retries_until_the_controller_comes_up(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tally.controller_client")
    sock = loopback_socket()  # refuses until the server listens on it: the port stays ours
    app = create_app(make_settings(tmp_path, port=port_of(sock)), backend=FakeBackend())
    sink = ControllerSink(f"http://127.0.0.1:{port_of(sock)}", None, timeout_s=1.0,
                          max_backoff_s=0.5, registration={
                              "config": {"name": "late"}, "output_dir": str(tmp_path)})
    try:
        for step in range(5):
            sink.write(step, METRICS)
        wait_for(lambda: sum("unreachable" in r.getMessage() for r in caplog.records) >= 2)
        assert sink.sent == 0 and sink.job_id is None  # a few failed tries, nothing lost
        with serve_in_thread(app, sock) as url:
            wait_for(lambda: sink.sent == 5)
            steps = httpx.get(f"{url}/api/jobs/{sink.job_id}/metrics").json()["steps"]
            assert steps == [0, 1, 2, 3, 4]
    finally:
        sink.close(timeout_s=1.0)
        sock.close()


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


def test_a_reported_error_is_its_cause_in_one_line() -> None:
    """The job view says the cause once; the traceback stays in the job's log."""
    from services.clients.controller import error_text
    from services.config.job import ConfigError, ConfigProblem

    try:
        raise RuntimeError("rank 0 died")
    except RuntimeError as err:
        assert error_text(err) == "RuntimeError: rank 0 died"
    several = ConfigError("job.yaml", [ConfigProblem("a", "x"), ConfigProblem("b", "y")],
                          "job.yaml: invalid job config\n  a: x\n  b: y")
    assert error_text(several) == ("services.config.errors.ConfigError: job.yaml: invalid job "
                                   "config; a: x; b: y")


def test_a_registered_job_presents_only_its_own_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """``TALLY_API_TOKEN`` in a job's environment is never sent: without
    ``TALLY_JOB_TOKEN`` a controller that needs a token refuses the registration, said in
    one line naming TALLY_JOB_TOKEN, and the sink stops; with it the job registers."""
    caplog.set_level(logging.WARNING, logger="tally.controller_client")
    config = parse_job_config("name: outside\nnum_steps: 3\n")
    app = create_app(make_settings(tmp_path, api_token="k3y"), backend=FakeBackend())
    with serve_in_thread(app) as url:
        monkeypatch.setenv("TALLY_CONTROLLER_URL", url)
        monkeypatch.delenv("TALLY_JOB_ID", raising=False)
        monkeypatch.delenv("TALLY_JOB_TOKEN", raising=False)
        monkeypatch.setenv("TALLY_API_TOKEN", "k3y")  # e.g. inherited from a Ray head
        with controller_sinks(config, tmp_path / "a") as sinks:
            sinks[0].write(0, METRICS)
            wait_for(lambda: sinks[0].refused)
            sinks[0].write(1, METRICS)
        assert sinks[0].job_id is None and sinks[0].sent == 0 and not sinks[0].queue
        [warning] = [r.getMessage() for r in caplog.records if "register" in r.getMessage()]
        assert "401" in warning and "TALLY_JOB_TOKEN" in warning and "\n" not in warning
        assert httpx.get(f"{url}/api/jobs").json()["items"] == []
        monkeypatch.setenv("TALLY_JOB_TOKEN", "k3y")
        with controller_sinks(config, tmp_path / "b") as sinks:
            sinks[0].write(0, METRICS)
        [job] = httpx.get(f"{url}/api/jobs").json()["items"]
        assert job["id"] == sinks[0].job_id and job["status"] == "succeeded"
