"""The places issue 50's review found still following links, each under the one rule
(rollout/confined.py): a session's state file, the driver's appends and rewrites of its
job folder's files, and the controller's removal of a job folder. A link is planted where
a second party on a shared volume could plant it; the file it points at must come out
untouched (and, for a read, unread). Real files and folders, the real app (TestClient) on
the in-memory Ray of controller_fakes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rollout.confined import Escapes
from services.driver.run_dir import EVENTS_FILE, replace_file, write_event
from services.driver.samples import append_samples, read_samples
from services.driver.sinks import JsonlSink, read_metrics, truncate_after
from services.sessions.server import (
    SECRET_FILE,
    SESSION_FILE,
    read_state,
    take_secret,
    write_state,
)
from tests.services.controller.fakes import DEMO, DEMO_OVERRIDES, api_client

TOKEN = "k3y"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VICTIM_TEXT = '{"step": 0, "state": "ready", "host": "127.0.0.1", "port": 1}\n'


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file the link points at: one no writer here may change, no reader may read."""
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "job"
    path.mkdir()
    return path


# ---- 1. a session's state file ----------------------------------------------------------

def test_session_state_is_never_written_through_a_link(folder: Path, victim: Path) -> None:
    (folder / f".{SESSION_FILE}.tmp").symlink_to(victim)  # the old staging name
    (folder / SESSION_FILE).symlink_to(victim)
    write_state(folder, {"state": "ready", "host": "10.0.0.1", "port": 41000})
    assert victim.read_text() == VICTIM_TEXT
    assert not (folder / SESSION_FILE).is_symlink()
    assert json.loads((folder / SESSION_FILE).read_text())["host"] == "10.0.0.1"
    assert read_state(folder) == {"state": "ready", "host": "10.0.0.1", "port": 41000}
    leftovers = {p.name for p in folder.iterdir()} - {SESSION_FILE, f".{SESSION_FILE}.tmp"}
    assert leftovers == set()  # the staged file was renamed into place


def test_session_state_and_secret_are_never_read_through_a_link(folder: Path,
                                                                victim: Path) -> None:
    (folder / SESSION_FILE).symlink_to(victim)
    assert read_state(folder) is None  # the linked state is never taken
    (folder / SECRET_FILE).symlink_to(victim)
    with pytest.raises(SystemExit, match="symbolic link"):
        take_secret(folder)


# ---- 2. the driver's job files ----------------------------------------------------------

def test_an_event_is_never_appended_through_a_link(folder: Path, victim: Path) -> None:
    write_event(folder, "placement", "rank 0 on node a")
    (folder / EVENTS_FILE).unlink()
    (folder / EVENTS_FILE).symlink_to(victim)
    with pytest.raises(Escapes, match=r"events\.jsonl: is a symbolic link"):
        write_event(folder, "restart", "restart 1/3")
    assert victim.read_text() == VICTIM_TEXT


def test_an_append_to_a_fifo_is_refused(folder: Path) -> None:
    os.mkfifo(folder / EVENTS_FILE)
    reader = os.open(folder / EVENTS_FILE, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(Escapes, match="not a regular file"):
            write_event(folder, "restart", "restart 1/3")
    finally:
        os.close(reader)
    os.unlink(folder / EVENTS_FILE)
    os.mkfifo(folder / EVENTS_FILE)  # nobody reads it: refused, not blocked on
    with pytest.raises(Escapes, match="not a regular file"):
        write_event(folder, "restart", "restart 1/3")


def test_metrics_rows_are_never_appended_through_a_link(folder: Path, victim: Path) -> None:
    (folder / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(Escapes, match="symbolic link"):
        JsonlSink(folder)
    (folder / "metrics.jsonl").unlink()
    sink = JsonlSink(folder)  # a real file, then a link swapped in under it
    sink.write(0, {"loss": 1.0})
    (folder / "metrics.jsonl").unlink()
    (folder / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(Escapes, match="symbolic link"):
        sink.write(1, {"loss": 0.5})
    sink.close()
    assert victim.read_text() == VICTIM_TEXT


def test_samples_are_never_appended_or_read_through_a_link(folder: Path,
                                                           victim: Path) -> None:
    (folder / "samples.jsonl").symlink_to(victim)
    with pytest.raises(Escapes, match="symbolic link"):
        append_samples(folder / "samples.jsonl", [{"step": 0, "text": "hello"}])
    assert victim.read_text() == VICTIM_TEXT
    with pytest.raises(Escapes, match="symbolic link"):
        read_samples(folder / "samples.jsonl")


def test_a_resume_never_writes_its_truncated_rows_through_a_link(folder: Path,
                                                                 victim: Path) -> None:
    metrics = folder / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "metrics": {}}) + "\n"
                               for s in range(4)))
    (folder / "metrics.jsonl.truncating").symlink_to(victim)
    truncate_after(metrics, 1)
    assert victim.read_text() == VICTIM_TEXT
    assert [row["step"] for row in read_metrics(metrics)] == [0, 1]
    assert not metrics.is_symlink()
    metrics.unlink()
    metrics.symlink_to(victim)  # the rows read on resume never come from a link
    with pytest.raises(Escapes, match="symbolic link"):
        truncate_after(metrics, 0)
    assert victim.read_text() == VICTIM_TEXT


def test_the_resolved_config_replaces_a_link_never_writes_through_it(folder: Path,
                                                                     victim: Path) -> None:
    (folder / "config.json").symlink_to(victim)
    replace_file(folder / "config.json", '{"name": "demo"}')
    assert victim.read_text() == VICTIM_TEXT
    assert not (folder / "config.json").is_symlink()
    assert (folder / "config.json").read_text() == '{"name": "demo"}'
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]


# ---- 3. DELETE /api/jobs/{id}?folder=true ----------------------------------------------

def ended_job(api: TestClient, *overrides: str) -> dict:
    """A demo job (with ``overrides``) Ray ran and ended, seen by a reconcile pass."""
    response = api.post("/api/jobs", headers=AUTH, json={
        "config_yaml": DEMO, "overrides": [*DEMO_OVERRIDES, *overrides]})
    assert response.status_code == 201, response.text
    job = response.json()
    api.ctl.reconciler.tick()
    api.backend.finish(f"tally-{job['id']}", "succeeded", "step 2/2\n")
    api.ctl.reconciler.tick()
    return job


def kept_folder(root: Path) -> Path:
    """A folder the link points at, inside the allowed roots (the model cache)."""
    kept = root / "models" / "precious"
    kept.mkdir(parents=True)
    (kept / "weights.bin").write_bytes(b"w" * 16)
    return kept


def test_a_job_folder_that_is_a_link_is_not_removed_through_it(tmp_path: Path) -> None:
    api = api_client(tmp_path, api_token=TOKEN)
    job = ended_job(api)
    kept = kept_folder(api.ctl.settings.data_dir)
    job_folder = Path(job["output_dir"])
    for child in job_folder.iterdir():
        child.unlink()
    job_folder.rmdir()
    job_folder.symlink_to(kept)  # the job folder swapped for a link to another folder
    response = api.delete(f"/api/jobs/{job['id']}", params={"folder": "true"}, headers=AUTH)
    assert response.status_code == 409, response.text
    assert "symbolic link" in response.json()["detail"] and job["id"] in response.text
    assert (kept / "weights.bin").read_bytes() == b"w" * 16 and job_folder.is_symlink()
    assert api.get(f"/api/jobs/{job['id']}").status_code == 200  # nothing deleted
    assert api.delete(f"/api/jobs/{job['id']}", headers=AUTH).status_code == 204
    assert (kept / "weights.bin").exists()


def test_a_link_between_the_root_and_the_job_folder_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "team").mkdir(parents=True)
    api = api_client(tmp_path, api_token=TOKEN, allowed_roots=(shared,))
    job = ended_job(api, f"output_dir={shared / 'team' / 'run'}")
    assert Path(job["output_dir"]).is_relative_to(shared / "team")
    elsewhere = shared / "elsewhere"  # the same names under another folder of the root
    (elsewhere / "run").mkdir(parents=True)
    (elsewhere / "run" / "keep.txt").write_text("mine")
    (shared / "team").rename(shared / "team-old")
    (shared / "team").symlink_to(elsewhere)
    response = api.delete(f"/api/jobs/{job['id']}", params={"folder": "true"}, headers=AUTH)
    assert response.status_code == 409, response.text
    assert "team is a symbolic link" in response.json()["detail"]
    assert (elsewhere / "run" / "keep.txt").read_text() == "mine"


def test_a_real_job_folder_is_still_removed(tmp_path: Path) -> None:
    api = api_client(tmp_path, api_token=TOKEN)
    job = ended_job(api)
    kept = kept_folder(api.ctl.settings.data_dir)
    assert Path(job["output_dir"]).is_dir()
    response = api.delete(f"/api/jobs/{job['id']}", params={"folder": "true"}, headers=AUTH)
    assert response.status_code == 204, response.text
    assert not Path(job["output_dir"]).exists() and (kept / "weights.bin").exists()
    assert api.get(f"/api/jobs/{job['id']}").status_code == 404
