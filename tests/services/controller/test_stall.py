"""A controller that cannot stall: session calls that never come back (a real TCP server
that accepts and never answers, standing in for a session's server) hold no worker
thread, so ``/healthz``, a job's status and a job's submission answer meanwhile; a call
past ``session_call_timeout_s`` is a 504 naming it; a Ray job server that never answers
is BackendUnavailable after ``timeout_s``; ``/readyz`` is not ``/healthz``. On a real
uvicorn in a thread, with Ray's job server in memory (the real one:
test_controller_sessions_ready.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from services.controller.app import THREADS, create_app
from services.controller.ray_jobs import BackendUnavailable, RayJobBackend
from services.controller.tables import Run
from services.sessions.server import write_state
from tests.services.controller.fakes import (
    DEMO,
    DEMO_OVERRIDES,
    FakeBackend,
    HungServer,
    api_client,
    make_settings,
    serve_in_thread,
)

HUNG_CALLS = THREADS + 8
"""More hung calls than the worker pool has threads: on a pool they would take it all."""


def hung_session(ctl, backend: FakeBackend, host: str, port: int) -> str:
    """A session row whose server (``session.json``) is ``host:port`` and whose Ray job
    runs (as far as the fake knows)."""
    session_id = "hung0000000a"
    folder = ctl.settings.sessions_dir / session_id
    folder.mkdir(parents=True)
    write_state(folder, {"state": "ready", "host": host, "port": port, "pid": 1})
    submission = f"tally-session-{session_id}"
    backend.submit(submission, "true", {}, {})
    backend.finish(submission, "running")
    now = time.time()
    ctl.store.add_run(Run(  # a ready session: its server answers (run_states.py)
        id=session_id, kind="session", name="session", status="running", mode="sample_mean",
        source="controller", num_steps=1, model="tiny", world_size=1, config_submitted="{}",
        config_resolved="{}", output_dir=str(folder), ray_submission_id=submission, step=0,
        tokens=0, pending_calls=0, created_at=now, updated_at=now))
    return session_id


def test_hung_session_calls_leave_health_status_and_submission_answering(
        tmp_path: Path) -> None:
    backend = FakeBackend()
    app = create_app(make_settings(tmp_path, session_call_timeout_s=60.0), backend=backend)
    with serve_in_thread(app) as url, ThreadPoolExecutor(HUNG_CALLS) as pool, \
            HungServer() as hung:
        ctl = app.state.controller
        session_id = hung_session(ctl, backend, hung.host, hung.port)
        body = {"config_yaml": DEMO, "overrides": DEMO_OVERRIDES}
        earlier = httpx.post(f"{url}/api/jobs", json=body, timeout=10).json()["id"]
        calls = [pool.submit(httpx.post, f"{url}/api/sessions/{session_id}/forward_backward",
                             json={"data": []}, timeout=90) for _ in range(HUNG_CALLS)]
        deadline = time.monotonic() + 30
        while len(hung.accepted) < HUNG_CALLS:  # every call reached the session, waits
            assert time.monotonic() < deadline, f"{len(hung.accepted)} reached the session"
            time.sleep(0.05)
        with httpx.Client(base_url=url, timeout=5) as http:
            http.get("/healthz")  # a connection made; then each answer is timed
            took = []
            for _ in range(5):
                started = time.perf_counter()
                assert http.get("/healthz").status_code == 200
                took.append(time.perf_counter() - started)
            assert max(took) < 0.1, took
            assert http.get(f"/api/jobs/{earlier}").json()["status"] in ("queued", "pending")
            submitted = http.post("/api/jobs", json=body)
            assert submitted.status_code == 201, submitted.text
            assert http.get(f"/api/jobs/{submitted.json()['id']}").status_code == 200
            assert http.get("/readyz").json()["ready"] is True
        assert not any(call.done() for call in calls)  # all still hung meanwhile
        hung.close()
        # the session's server went away: each hung call ended (a 503 saying so)
        assert {call.result(timeout=30).status_code for call in calls} == {503}


def test_a_session_call_past_its_timeout_is_a_504_naming_the_setting(tmp_path: Path) -> None:
    api = api_client(tmp_path, session_call_timeout_s=0.5)
    with HungServer() as hung:
        session_id = hung_session(api.ctl, api.backend, hung.host, hung.port)
        started = time.monotonic()
        answer = api.post(f"/api/sessions/{session_id}/optim_step", json={})
        assert time.monotonic() - started < 5
    assert answer.status_code == 504
    assert "session_call_timeout_s" in answer.json()["detail"]


def test_a_ray_job_server_that_never_answers_is_unavailable_after_the_timeout() -> None:
    with HungServer() as hung:
        address = f"http://{hung.host}:{hung.port}"
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match=f"Ray job server {address}"):
            RayJobBackend(address, timeout_s=0.5).info("tally-x")
        assert time.monotonic() - started < 5


def test_ready_is_not_live_while_the_job_server_is_down(tmp_path: Path) -> None:
    backend = FakeBackend()
    backend.down = True
    with TestClient(create_app(make_settings(tmp_path), backend=backend)) as api:
        assert api.get("/healthz").status_code == 200
        answer = api.get("/readyz")
        assert answer.status_code == 503
        assert answer.json()["detail"] == "ray: fake Ray is down"
        assert answer.json()["database"] and answer.json()["static"]
        backend.down = False
        deadline = time.monotonic() + 10
        while (answer := api.get("/readyz")).status_code != 200:
            assert time.monotonic() < deadline, answer.json()
            time.sleep(0.05)
        assert answer.json() == {"ready": True, "database": True, "ray": True,
                                 "static": True, "detail": ""}
