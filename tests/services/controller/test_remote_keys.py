"""An API key named by a remote reward part (``api_key_file``) through the controller's
REST API on a real SQLite file: the key file is checked at submit (0600, inside the
allowed roots, refused naming the field), and the key is in nothing the controller
stores or hands to Ray — its database, the job folder, the Ray job's entrypoint and
environment. (tests/e2e/test_http_reward_job.py greps a job's own folder and logs.)"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from tests.services.controller.fakes import DEMO, DEMO_OVERRIDES, api_client

KEY = "sk-controller-5e0c2a9b7d41f386"


def _submit(api: TestClient, key_file: str) -> TestClient:
    reward = ("rollout.reward=[{type: exact_match}, {type: http, name: remote, "
              f"url: 'http://127.0.0.1:9/get_reward', api_key_file: '{key_file}'}}]")
    return api.post("/api/jobs", json={"config_yaml": DEMO,
                                       "overrides": [*DEMO_OVERRIDES, reward]})


def _key_file(folder: Path, mode: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "remote.key"
    path.write_text(KEY + "\n")
    path.chmod(mode)
    return path


def test_a_key_file_is_used_by_path_and_its_key_stored_nowhere(tmp_path: Path) -> None:
    api = api_client(tmp_path)
    data = api.ctl.settings.data_dir
    key_file = _key_file(data / "secrets", 0o600)
    response = _submit(api, "secrets/remote.key")  # relative: from the data folder
    assert response.status_code == 201, response.text
    job = response.json()
    part = job["config_resolved"]["rollout"]["reward"][1]
    assert part["api_key_file"] == str(key_file)
    api.ctl.reconciler.tick()
    [ray_job] = api.backend.jobs.values()
    assert KEY not in json.dumps(ray_job, default=str)
    assert KEY not in json.dumps(api.get(f"/api/jobs/{job['id']}").json())

    stored = [p for p in tmp_path.rglob("*") if p.is_file() and p != key_file]
    assert any(p.suffix in (".db", ".sqlite", ".sqlite3") for p in stored), stored
    assert any(Path(job["output_dir"]) in p.parents for p in stored), stored
    assert not [str(p) for p in stored if KEY.encode() in p.read_bytes()]


def test_a_key_file_others_may_read_or_outside_the_roots_is_refused(tmp_path: Path
                                                                    ) -> None:
    api = api_client(tmp_path)
    data = api.ctl.settings.data_dir
    _key_file(data / "open", 0o644)
    response = _submit(api, "open/remote.key")
    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    assert error["field"] == "rollout.reward[1].api_key_file"
    assert "readable or writable by group or others (mode 644); chmod 600" in \
        error["message"]

    outside = _key_file(tmp_path / "elsewhere", 0o600)
    response = _submit(api, str(outside))
    assert response.status_code == 422, response.text
    assert [e["field"] for e in response.json()["errors"]] == [
        "rollout.reward[1].api_key_file"]
    assert "outside the allowed roots" in response.text
    assert api.get("/api/jobs").json()["total"] == 0
