"""Training sessions queue like jobs (services/controller/submit_service.py, reconcile.py):
one that the free cluster cannot hold is stored ``queued`` with a waiting reason and started
in its turn, one first-come-first-served queue over jobs and sessions; one larger than the
whole cluster is refused at once. The real app and SQLite store, Ray's job server in memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.controller.app import create_app
from services.sessions.server import IDLE_ENV
from tests.services.controller.fakes import DEMO, DEMO_OVERRIDES, FakeBackend, make_settings

SESSION = {"config": {"rollout": {"model": "tiny"}}}
"""1 trainer rank and 1 engine: 1.5 CPU (a demo job: 1.25)."""


@pytest.fixture
def api(tmp_path: Path) -> TestClient:
    backend = FakeBackend()
    backend.usage = {"CPU": (0.0, 2.0)}  # a two-CPU cluster: one job or one session
    app = create_app(make_settings(tmp_path, max_running_jobs=4), backend=backend)
    client = TestClient(app)
    client.backend = backend  # type: ignore[attr-defined]
    client.ctl = app.state.controller  # type: ignore[attr-defined]
    return client


def submit_job(api: TestClient) -> str:
    response = api.post("/api/jobs", json={"config_yaml": DEMO, "overrides": DEMO_OVERRIDES})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def job_status(api: TestClient, job_id: str) -> str:
    return api.get(f"/api/jobs/{job_id}").json()["status"]


def session(api: TestClient, session_id: str) -> dict:
    return api.get(f"/api/sessions/{session_id}").json()


def in_ray(api: TestClient, session_id: str) -> bool:
    return f"tally-session-{session_id}" in api.backend.jobs  # type: ignore[attr-defined]


def end_job(api: TestClient, job_id: str) -> None:
    api.backend.finish(f"tally-{job_id}", "succeeded")  # type: ignore[attr-defined]
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]


def test_a_session_waits_while_a_job_holds_the_cluster_then_starts(api: TestClient) -> None:
    job = submit_job(api)
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]
    assert job_status(api, job) == "pending"
    created = api.post("/api/sessions", json=SESSION)
    assert created.status_code == 201, created.text
    queued = created.json()
    assert queued["status"] == "queued"
    assert queued["waiting"] == "waiting for resources: needs 1.5 CPU, cluster has 0.75 free"
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]
    assert session(api, queued["id"])["status"] == "queued"
    assert session(api, queued["id"])["waiting"] == queued["waiting"]
    assert not in_ray(api, queued["id"])

    end_job(api, job)  # the job ends: the same pass starts the session
    assert job_status(api, job) == "succeeded"
    started = session(api, queued["id"])
    assert (started["status"], started["waiting"]) == ("starting", None)
    ray_job = api.backend.jobs[f"tally-session-{queued['id']}"]  # type: ignore[attr-defined]
    assert f"services.sessions.server {started['output_dir']}" in ray_job["entrypoint"]
    assert float(ray_job["env"][IDLE_ENV]) == api.ctl.settings.session_idle_timeout_s  # type: ignore[attr-defined]


def test_a_session_larger_than_the_cluster_is_refused_at_once(api: TestClient) -> None:
    big = {"config": {"rollout": {"model": "tiny"}, "trainer": {"dp_size": 3}}}
    response = api.post("/api/sessions", json=big)
    assert response.status_code == 422, response.text
    assert "it needs 3.5 CPU, the cluster has 2 CPU in all" in response.json()["detail"]
    assert api.get("/api/sessions").json()["items"] == []
    assert api.backend.jobs == {}  # type: ignore[attr-defined]


def test_one_queue_first_come_first_served_over_jobs_and_sessions(api: TestClient) -> None:
    first = submit_job(api)
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]
    second = submit_job(api)  # queued before the session: started before it
    queued = api.post("/api/sessions", json=SESSION).json()
    third = submit_job(api)  # queued after the session: held back by it
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]
    assert [job_status(api, j) for j in (second, third)] == ["queued", "queued"]

    end_job(api, first)
    assert job_status(api, second) == "pending"
    assert session(api, queued["id"])["status"] == "queued" and not in_ray(api, queued["id"])

    end_job(api, second)
    assert session(api, queued["id"])["status"] == "starting" and in_ray(api, queued["id"])
    assert job_status(api, third) == "queued"  # 0.5 CPU left beside the session


def test_a_queued_session_ended_before_its_turn_never_starts(api: TestClient) -> None:
    job = submit_job(api)
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]
    queued = api.post("/api/sessions", json=SESSION).json()
    assert api.delete(f"/api/sessions/{queued['id']}").json()["status"] == "ended"
    end_job(api, job)
    assert session(api, queued["id"])["status"] == "ended" and not in_ray(api, queued["id"])


def test_a_call_to_a_queued_session_is_503_saying_its_place_in_the_queue(api: TestClient
                                                                        ) -> None:
    job = submit_job(api)
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]
    waiting_job = submit_job(api)  # first in the queue
    queued = api.post("/api/sessions", json=SESSION).json()
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]
    answer = api.post(f"/api/sessions/{queued['id']}/forward", json={"data": []})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "10"
    assert answer.json()["detail"] == (
        f"session {queued['id']} is queued (position 2 of 2 in the queue): "
        f"{session(api, queued['id'])['waiting']}")
    end_job(api, job)  # the waiting job starts: the session is first now
    assert job_status(api, waiting_job) == "pending"
    answer = api.post(f"/api/sessions/{queued['id']}/sample", json={})
    assert answer.status_code == 503
    assert f"session {queued['id']} is queued (position 1 of 1" in answer.json()["detail"]


def test_a_queued_session_starts_with_what_its_row_holds_never_its_folder(api: TestClient
                                                                          ) -> None:
    """The environment of a queued session's server is rebuilt from its row when its turn
    comes (job_env.run_env): a ``.launch.json`` someone wrote into its folder meanwhile (a
    Ray pod may write there) is not read."""
    job = submit_job(api)
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]
    queued = api.post("/api/sessions", json={**SESSION, "idle_timeout_s": 77}).json()
    folder = Path(queued["output_dir"])
    assert not (folder / ".launch.json").exists()
    (folder / ".launch.json").write_text(json.dumps({
        IDLE_ENV: "1", "TALLY_API_TOKEN": "stolen", "LD_PRELOAD": "/tmp/evil.so"}))
    end_job(api, job)
    assert session(api, queued["id"])["status"] == "starting"
    env = api.backend.jobs[f"tally-session-{queued['id']}"]["env"]  # type: ignore[attr-defined]
    assert env == {IDLE_ENV: "77.0", "TALLY_DATA_DIR": str(api.ctl.settings.data_dir)}  # type: ignore[attr-defined]


def test_the_one_poller_makes_a_session_ready_and_ends_it(api: TestClient) -> None:
    """No call needed: the reconcile loop's poller, which ends jobs, sees a session's
    server ready (its session.json) and its end (idle, its state saved)."""
    started = api.post("/api/sessions", json=SESSION).json()
    assert started["status"] == "starting"
    folder = Path(started["output_dir"])
    api.backend.finish(f"tally-session-{started['id']}", "running")  # type: ignore[attr-defined]
    (folder / "session.json").write_text(json.dumps(
        {"state": "ready", "host": "127.0.0.1", "port": 41000}))
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]
    assert api.get("/api/sessions").json()["items"][0]["status"] == "ready"
    (folder / "session.json").write_text(json.dumps(
        {"state": "ended", "reason": "idle", "saved_path": str(folder / "saved" / "idle")}))
    api.ctl.reconciler.tick()  # type: ignore[attr-defined]
    ended = api.get("/api/sessions").json()["items"][0]
    assert (ended["status"], ended["saved_path"]) == ("ended", str(folder / "saved" / "idle"))
