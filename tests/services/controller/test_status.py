"""The driver ↔ controller status contract, through the HTTP app (Ray faked): a job the
controller submitted ends when Ray says so. A reported end Ray contradicts is refused
with 409, and a cancel stops a Ray job that still runs whatever the store says."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.services.controller.fakes import DEMO, DEMO_OVERRIDES, api_client


@pytest.fixture
def api(tmp_path: Path):
    return api_client(tmp_path)


def running_job(api: TestClient) -> str:
    """A submitted job that Ray runs (and the store knows it)."""
    response = api.post("/api/jobs", json={"config_yaml": DEMO, "overrides": DEMO_OVERRIDES})
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    api.ctl.reconciler.tick()
    api.backend.jobs[f"tally-{job_id}"]["status"] = "running"
    api.ctl.reconciler.tick()
    assert api.get(f"/api/jobs/{job_id}").json()["status"] == "running"
    return job_id


def test_an_end_reported_while_ray_runs_the_job_is_refused(api: TestClient) -> None:
    job_id = running_job(api)
    for status in ("succeeded", "failed"):
        response = api.post(f"/api/jobs/{job_id}/status", json={"status": status})
        assert response.status_code == 409, response.text
        assert f"Ray reports job {job_id} running" in response.json()["detail"]
    assert api.get(f"/api/jobs/{job_id}").json()["status"] == "running"
    assert api.post(f"/api/jobs/{job_id}/status", json={"status": "running"}).status_code == 200
    cancelled = api.post(f"/api/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert api.backend.jobs[f"tally-{job_id}"]["status"] == "cancelled"  # stopped in Ray


def test_the_end_comes_from_ray_and_a_report_ray_confirms_is_taken(api: TestClient) -> None:
    job_id = running_job(api)
    api.backend.finish(f"tally-{job_id}", "failed", "ValueError: boom\n", "exit code 1")
    wrong = api.post(f"/api/jobs/{job_id}/status", json={"status": "succeeded"})
    assert wrong.status_code == 409
    assert wrong.json()["detail"] == f"Ray reports job {job_id} failed, not succeeded"
    agreed = api.post(f"/api/jobs/{job_id}/status", json={"status": "failed", "error": "boom"})
    assert agreed.status_code == 200, agreed.text
    assert (agreed.json()["status"], agreed.json()["error"]) == ("failed", "boom")
    api.ctl.reconciler.tick()  # Ray's end confirmed: its logs saved, the report's error kept
    done = api.get(f"/api/jobs/{job_id}").json()
    assert (done["status"], done["error"], done["log_tail"]) == ("failed", "boom",
                                                                "ValueError: boom")


def test_cancel_stops_a_ray_job_the_store_thinks_ended(api: TestClient) -> None:
    """An end stored without Ray's word (a database from before this check) does not
    keep a cancel from stopping the Ray job that still runs."""
    job_id = running_job(api)
    api.ctl.store.transition(job_id, "succeeded")
    response = api.post(f"/api/jobs/{job_id}/cancel")
    assert response.status_code == 200, response.text
    assert (response.json()["status"], response.json()["error"]) == (
        "cancelled", "cancelled by the user")
    assert api.backend.jobs[f"tally-{job_id}"]["status"] == "cancelled"
    api.ctl.reconciler.tick()  # Ray now says stopped: the end is confirmed
    assert api.get(f"/api/jobs/{job_id}").json()["status"] == "cancelled"
    assert api.post(f"/api/jobs/{job_id}/cancel").status_code == 200  # idempotent


def test_cancel_of_a_job_ray_ended_still_answers_how_it_ended(api: TestClient) -> None:
    job_id = running_job(api)
    api.backend.finish(f"tally-{job_id}", "succeeded")
    api.ctl.reconciler.tick()
    response = api.post(f"/api/jobs/{job_id}/cancel")
    assert response.status_code == 409 and "already succeeded" in response.text


def test_a_queued_job_cannot_be_reported_ended(api: TestClient) -> None:
    job_id = api.post("/api/jobs", json={"config_yaml": DEMO,
                                         "overrides": DEMO_OVERRIDES}).json()["id"]
    response = api.post(f"/api/jobs/{job_id}/status", json={"status": "succeeded"})
    assert response.status_code == 409 and "queued" in response.json()["detail"]
    assert api.get(f"/api/jobs/{job_id}").json()["status"] == "queued"


def test_a_report_is_503_while_ray_cannot_be_asked(api: TestClient) -> None:
    job_id = running_job(api)
    api.backend.down = True
    response = api.post(f"/api/jobs/{job_id}/status", json={"status": "succeeded"})
    assert response.status_code == 503 and "cannot reach Ray" in response.text
    assert api.get(f"/api/jobs/{job_id}").json()["status"] == "running"
