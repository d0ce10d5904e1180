"""Race-free status over real HTTP on loopback and a real SQLite file: a user's cancel and
the driver's "succeeded" sent at the same moment, 100 times; exactly one wins each time,
whole (never 'succeeded' with "cancelled by the user"), and the cancel's answer says
which."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from services.controller.app import create_app
from services.controller.tables import Run
from tests.services.controller.fakes import FakeBackend, make_settings, serve_in_thread

NUM_PAIRS = 100


def running_jobs(app, count: int) -> list[str]:
    store = app.state.controller.store
    now = time.time()
    ids = [f"race{i:04d}" for i in range(count)]
    store.add_jobs([Run(id=i, name=i, status="running", mode="sample_mean", source="controller",
                        config_submitted="{}", overrides="[]", config_resolved="{}",
                        output_dir=f"/nonexistent/{i}", num_steps=2, created_at=now,
                        started_at=now, updated_at=now) for i in ids])
    return ids


def test_concurrent_cancel_and_succeed_never_mix(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    ids = running_jobs(app, NUM_PAIRS)
    inconsistent = []
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http, \
            ThreadPoolExecutor(16) as pool:
        def pair(job_id: str) -> tuple[str, httpx.Response, httpx.Response]:
            go = threading.Barrier(2)

            def cancel() -> httpx.Response:
                go.wait()
                return http.post(f"/api/jobs/{job_id}/cancel")

            def succeed() -> httpx.Response:
                go.wait()
                return http.post(f"/api/jobs/{job_id}/status", json={"status": "succeeded"})

            with ThreadPoolExecutor(2) as two:
                cancelled, succeeded = two.submit(cancel), two.submit(succeed)
                return job_id, cancelled.result(), succeeded.result()

        for job_id, cancelled, succeeded in pool.map(pair, ids):
            job = http.get(f"/api/jobs/{job_id}").json()
            assert succeeded.status_code == 200, succeeded.text
            whole = ((job["status"], job["error"]) in
                     (("cancelled", "cancelled by the user"), ("succeeded", None)))
            answer = {200: "cancelled", 409: "succeeded"}.get(cancelled.status_code)
            if not whole or answer != job["status"] or job["finished_at"] is None:
                inconsistent.append((job_id, job["status"], job["error"], cancelled.text))
    assert inconsistent == [], f"{len(inconsistent)} of {NUM_PAIRS}: {inconsistent[:3]}"


def test_a_transition_reports_whether_it_won(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    store = app.state.controller.store
    (job_id,) = running_jobs(app, 1)
    job, won = store.advance(job_id, "succeeded")
    assert won and job is not None and job.status == "succeeded"
    job, won = store.advance(job_id, "cancelled", error="cancelled by the user")
    assert not won and job is not None and (job.status, job.error) == ("succeeded", None)
    job, won = store.advance(job_id, "running")
    assert not won and job is not None and job.status == "succeeded"


def test_a_job_and_a_session_move_by_one_state_machine(tmp_path: Path) -> None:
    """Both kinds go forward only through Store.advance (run_states.py): a late 'pending'
    never hides 'running', an end is final, and a session's words follow its status."""
    from services.controller.routes_sessions import session_out

    store = create_app(make_settings(tmp_path), backend=FakeBackend()).state.controller.store
    now = time.time()
    for run_id, kind in (("job1", "job"), ("ses1", "session")):
        store.add_run(Run(id=run_id, kind=kind, name=run_id, status="queued",
                          mode="sample_mean", source="controller", config_submitted="{}",
                          config_resolved="{}", output_dir=f"/nonexistent/{run_id}",
                          num_steps=2, created_at=now, updated_at=now))
        assert store.advance(run_id, "running")[1]  # a skip forward
        assert not store.advance(run_id, "pending")[1]  # never back
        assert store.get_run(run_id).status == "running"
        assert store.advance(run_id, "cancelled")[1]
        assert not store.advance(run_id, "succeeded")[1]  # an end is final
        assert not store.advance(run_id, "failed")[1]
    assert store.get_job("job1").status == "cancelled" and store.get_job("ses1") is None
    assert session_out(store.get_session("ses1"))["status"] == "ended"
    assert store.get_session("job1") is None
