"""The controller never follows a job folder's links (issue 50): a job folder is written
by the job, and on a shared volume by anyone of the same uid. A ``driver.log`` or
``events.jsonl`` planted as a link to the controller's own secrets is never read (the
route names the file), the reconciler never writes a finished job's output through one,
log reads are bounded, job-written reads need a token off loopback, session.json may not
send the controller elsewhere, and the database keeps no dropped secret and is private.
Real app (TestClient), real SQLite; Ray is the in-memory job server of controller_fakes."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config as AlembicConfig
from fastapi.testclient import TestClient

from services.controller.auth import job_token
from services.controller.job_files import own_log
from services.controller.session_rows import ready_url
from services.controller.store import MIGRATIONS, Store
from services.controller.tables import Run
from services.driver.run_dir import JOB_CONFIG_FILE
from services.sessions.server import write_state
from tests.services.controller.fakes import DEMO, DEMO_OVERRIDES, api_client

TOKEN = "k3y"
SECRET = "TALLY_API_TOKEN=s3cret-of-the-controller"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api(tmp_path: Path) -> TestClient:
    return api_client(tmp_path, api_token=TOKEN)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file only the controller should read: a valid event line, so that a read through
    a link to it would show it as one."""
    path = tmp_path / "environ"
    path.write_text(json.dumps({"time": 1.0, "kind": "leak", "message": SECRET}) + "\n")
    return path


def submit(api: TestClient) -> dict:
    response = api.post("/api/jobs", json={"config_yaml": DEMO, "overrides": DEMO_OVERRIDES},
                        headers=AUTH)
    assert response.status_code == 201, response.text
    return response.json()


def ended_in_ray(api: TestClient, logs: str, forget: bool = True) -> dict:
    """A job Ray ran and ended with ``logs``, saved by a reconcile pass; ``forget``: Ray
    forgot it since (what is left is the controller's copy or the job folder)."""
    job = submit(api)
    api.ctl.reconciler.tick()
    api.backend.finish(f"tally-{job['id']}", "succeeded", logs)
    api.ctl.reconciler.tick()
    if forget:
        api.backend.jobs.clear()
    return job


def test_a_linked_driver_log_is_refused_naming_it(api: TestClient, secret: Path) -> None:
    job = submit(api)  # never run by Ray here: the job folder's driver.log is what is read
    before = secret.read_bytes()
    (Path(job["output_dir"]) / "driver.log").symlink_to(secret)
    response = api.get(f"/api/jobs/{job['id']}/logs", headers=AUTH)
    assert response.status_code == 409
    assert "driver.log" in response.json()["detail"] and "symbolic link" in response.text
    assert "s3cret" not in response.text and secret.read_bytes() == before


def test_a_linked_events_file_is_refused_naming_it(api: TestClient, secret: Path) -> None:
    job = submit(api)
    (Path(job["output_dir"]) / "events.jsonl").symlink_to(secret)
    detail = api.get(f"/api/jobs/{job['id']}", headers=AUTH)
    assert detail.status_code == 200 and "s3cret" not in detail.text
    [event] = detail.json()["events"]
    assert event["kind"] == "refused" and event["message"].startswith("events.jsonl:")


def test_a_finished_jobs_output_is_never_written_through_a_link(api: TestClient,
                                                                secret: Path) -> None:
    job = submit(api)
    api.ctl.reconciler.tick()
    before = secret.read_bytes()
    (Path(job["output_dir"]) / "driver.log").symlink_to(secret)
    api.backend.finish(f"tally-{job['id']}", "succeeded", "step 2/2\n")
    api.ctl.reconciler.tick()
    assert secret.read_bytes() == before  # the linked file is unchanged
    saved = own_log(api.ctl.settings, job["id"])
    assert saved.read_text() == "step 2/2\n"
    assert not saved.is_relative_to(Path(job["output_dir"]).parent)  # not in jobs/
    api.backend.jobs.clear()  # Ray forgot it: the route reads the controller's copy
    assert api.get(f"/api/jobs/{job['id']}/logs", headers=AUTH).text == "step 2/2\n"


def test_a_log_read_is_bounded_to_its_last_bytes(api: TestClient) -> None:
    lines = "".join(f"line {i:07d}\n" for i in range(300_000))  # 3.6 MB
    for forget in (False, True):  # from Ray, then from the controller's copy
        job = ended_in_ray(api, lines, forget)
        url = f"/api/jobs/{job['id']}/logs"
        whole = api.get(url, headers=AUTH).text
        assert len(whole.encode()) == 1 << 20 and whole.endswith("line 0299999\n")
        assert api.get(url, params={"bytes": 26}, headers=AUTH).text == \
            "line 0299998\nline 0299999\n"
        assert api.get(url, params={"tail": 1}, headers=AUTH).text == "line 0299999\n"
        assert api.get(url, params={"bytes": (64 << 20) + 1}, headers=AUTH
                       ).status_code == 422


def test_job_written_reads_need_a_token_off_loopback(api: TestClient) -> None:
    job = ended_in_ray(api, "step 2/2\n")
    reads = [f"/api/jobs/{job['id']}/logs", f"/api/jobs/{job['id']}/samples"]
    own = {"Authorization": f"Bearer {job_token(TOKEN, job['id'])}"}
    other = {"Authorization": f"Bearer {job_token(TOKEN, 'another-job')}"}
    for url in reads:  # TestClient's client is "testclient": not loopback
        assert api.get(url).status_code == 401
        assert api.get(url, headers=other).status_code == 401
        assert api.get(url, headers=own).status_code == 200
        assert api.get(url, headers=AUTH).status_code == 200
    loopback = TestClient(api.app, client=("127.0.0.1", 50000))
    for url in reads:
        assert loopback.get(url).status_code == 200  # the dashboard on loopback
    (Path(job["output_dir"]) / "events.jsonl").write_text(
        json.dumps({"time": 1.0, "kind": "placed", "message": "rank 0 on node a"}) + "\n")
    assert api.get(f"/api/jobs/{job['id']}").json()["events"] == []  # shown less
    assert api.get(f"/api/jobs/{job['id']}", headers=own).json()["events"][0]["kind"] == \
        "placed"


def test_session_json_may_only_name_a_node_address(tmp_path: Path, secret: Path) -> None:
    row = Run(kind="session", id="s", output_dir=str(tmp_path / "s"))
    (tmp_path / "s").mkdir()
    for host, port, advertised, url in [
            ("10.1.2.3", 41000, None, "http://10.1.2.3:41000"),
            ("127.0.0.1", 41000, None, "http://127.0.0.1:41000"),
            ("attacker.example.com", 41000, None, None),  # a name not advertised
            ("tally-sessions.ml.svc", 41000, "tally-sessions.ml.svc",
             "http://tally-sessions.ml.svc:41000"),
            ("169.254.169.254", 80, None, None),  # a cloud's metadata server
            ("8.8.8.8", 443, None, None),  # a public address
            ("0.0.0.0", 41000, None, None),
            ("10.1.2.3", "41000", None, None), ("10.1.2.3", 0, None, None),
            ("10.1.2.3", 70000, None, None), ("10.1.2.3", True, None, None)]:
        write_state(tmp_path / "s", {"state": "ready", "host": host, "port": port})
        found = ready_url(row, advertised) if advertised else ready_url(row)
        assert found == url, (host, port)
    (tmp_path / "s" / "session.json").unlink()
    secret.write_text(json.dumps({"state": "ready", "host": "127.0.0.1", "port": 1}))
    (tmp_path / "s" / "session.json").symlink_to(secret)
    assert ready_url(row) is None  # a link is never read


def test_the_migration_leaves_no_dropped_secret_in_the_db_or_its_wal(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'controller.db'}"
    store = Store(url)
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url)
    with store.engine.begin() as connection:  # a database from before 0004
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "0003")
    residue = b"f00dcafe" * 8  # a session's 64-hex secret
    with store.engine.begin() as connection:
        connection.execute(sa.text(
            "INSERT INTO sessions VALUES ('s1', 'ready', 'tiny', 1, '{}', '{}', '/x', "
            "'tally-s1', :secret, 0, 0, NULL, 0, NULL, NULL, 1.0, 1.0)"
        ).bindparams(secret=residue.decode()))
    store.migrate()
    files = [tmp_path / "controller.db", tmp_path / "controller.db-wal"]
    for path in files:  # read while the store is open: its WAL not yet folded in on close
        assert not path.exists() or residue not in path.read_bytes(), path.name
    store.close()


def test_the_data_folder_database_and_job_files_are_private(api: TestClient) -> None:
    job = ended_in_ray(api, "step 2/2\n")
    data = api.ctl.settings.data_dir
    folder = Path(job["output_dir"])

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(data) == 0o700
    assert mode(folder) == 0o700 and mode(folder / JOB_CONFIG_FILE) == 0o600
    assert mode(own_log(api.ctl.settings, job["id"]).parent) == 0o700
    assert mode(own_log(api.ctl.settings, job["id"])) == 0o600
    database = data / "controller.db"
    assert mode(database) == 0o600
    for extra in ("controller.db-wal", "controller.db-shm"):
        if (data / extra).exists():
            assert mode(data / extra) == 0o600, extra
