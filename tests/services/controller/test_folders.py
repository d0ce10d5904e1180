"""Job folders no other job can touch, and housekeeping (real HTTP on loopback, SQLite;
Ray faked): a config's output_dir naming another job's folder, the model or warm-up
caches or the data folder itself is a 422 naming output_dir; a registered job's folder
outside the allowed roots is never read or written; DELETE of an ended job; an
Idempotency-Key submit returns the first job."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from services.controller.app import create_app
from tests.services.controller.fakes import (
    DEMO,
    DEMO_OVERRIDES,
    FakeBackend,
    make_settings,
    serve_in_thread,
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[httpx.Client, Path, FakeBackend, object]]:
    backend = FakeBackend()
    app = create_app(make_settings(tmp_path), backend=backend)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield http, tmp_path / "data", backend, app.state.controller


def submit(http: httpx.Client, *overrides: str, path: str = "/api/jobs", **extra
           ) -> httpx.Response:
    return http.post(path, json={"config_yaml": DEMO,
                                 "overrides": [*DEMO_OVERRIDES, *overrides], **extra})


def test_output_dirs_that_touch_shared_or_other_folders_are_422(server) -> None:
    http, data, _, _ = server
    first = submit(http, "output_dir=runs/first").json()
    queued = submit(http).json()
    config_file = Path(queued["output_dir"]) / "job_config.yaml"
    before = config_file.read_text()
    for value, why in [
        (queued["output_dir"], "inside the controller's job folders"),
        ("jobs", "inside the controller's job folders"),
        ("models/tiny", "inside the model cache"),
        ("warmup", "inside the warm-up cache"),
        (".", "is the data folder"),
        ("runs/first", "overlaps the folder of another job"),
        ("runs/first/inner", "overlaps the folder of another job"),
        ("runs", "overlaps the folder of another job"),
    ]:
        response = submit(http, f"output_dir={value}")
        assert response.status_code == 422, (value, response.text)
        errors = response.json()["errors"]
        assert errors[0]["field"] == "output_dir" and why in errors[0]["message"], errors
        sweep = submit(http, f"output_dir={value}", path="/api/sweeps", modes=["token_mean"])
        assert sweep.status_code == 422 and "output_dir" in sweep.text, value
    assert config_file.read_text() == before
    assert http.get("/api/jobs").json()["total"] == 2
    assert Path(first["output_dir"]) == data / "runs" / "first"
    assert submit(http, "output_dir=runs/second").status_code == 201


def test_an_allowed_root_holding_the_data_folder_is_still_not_a_job_folder(
        tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path, allowed_roots=(tmp_path,)), backend=FakeBackend())
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        response = submit(http, f"output_dir={tmp_path}")
        assert response.status_code == 422
        assert "is the data folder, or holds it" in response.json()["errors"][0]["message"]
        assert submit(http, f"output_dir={tmp_path / 'scratch'}").status_code == 201


def test_a_registered_folder_outside_the_roots_is_never_read_or_written(
        server, tmp_path: Path) -> None:
    http, _, backend, ctl = server
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "events.jsonl").write_text(
        '{"time": 1.0, "kind": "placement", "message": "secret"}\n')
    (outside / "driver.log").write_text("secret log\n")
    (outside / "metrics.jsonl").write_text('{"step": 0, "metrics": {"pg_loss": 1.0}}\n')
    job = http.post("/api/jobs/register", json={"config": {"name": "outside", "num_steps": 1},
                                                "output_dir": str(outside)}).json()
    assert job["events"] == []
    assert "secret" not in http.get(f"/api/jobs/{job['id']}/logs").text
    ctl.reconciler.tick()
    assert http.get(f"/api/jobs/{job['id']}/metrics").json()["steps"] == []
    # its Ray submission ends: the logs are not written into the foreign folder
    ctl.store.update_run(job["id"], ray_submission_id="raysub")
    backend.jobs["raysub"] = {"status": "succeeded", "entrypoint": "", "env": {},
                              "logs": "from ray\n", "message": None}
    ctl.reconciler.tick()
    assert (outside / "driver.log").read_text() == "secret log\n"
    assert http.get(f"/api/jobs/{job['id']}").json()["status"] == "succeeded"


def test_delete_a_finished_job_and_its_folder(server) -> None:
    http, _, _, ctl = server
    job = submit(http).json()
    assert http.delete(f"/api/jobs/{job['id']}").status_code == 409  # still queued
    http.post(f"/api/jobs/{job['id']}/metrics", json={"rows": [
        {"step": 0, "metrics": {"pg_loss": 1.0}}]})
    http.post(f"/api/jobs/{job['id']}/cancel")
    assert http.delete(f"/api/jobs/{job['id']}", params={"folder": True}).status_code == 204
    assert http.get(f"/api/jobs/{job['id']}").status_code == 404
    assert not Path(job["output_dir"]).exists()
    assert ctl.store.read_metrics(job["id"]) == []
    assert http.delete(f"/api/jobs/{job['id']}").status_code == 404
    kept = submit(http).json()
    http.post(f"/api/jobs/{kept['id']}/cancel")
    assert http.delete(f"/api/jobs/{kept['id']}").status_code == 204
    assert Path(kept["output_dir"]).is_dir()  # the folder stays unless asked


def test_idempotency_key_returns_the_first_job(server) -> None:
    http, _, _, _ = server
    def keyed(key: str) -> httpx.Response:
        return http.post("/api/jobs", headers={"Idempotency-Key": key}, json={
            "config_yaml": DEMO, "overrides": DEMO_OVERRIDES})

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: keyed("submit-42"), range(4)))
    assert sorted(a.status_code for a in answers) == [200, 200, 200, 201]
    assert len({a.json()["id"] for a in answers}) == 1
    assert http.get("/api/jobs").json()["total"] == 1
    assert keyed("other").status_code == 201
    assert submit(http).status_code == 201
    assert http.get("/api/jobs").json()["total"] == 3
