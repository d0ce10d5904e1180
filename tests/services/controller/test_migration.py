"""Revision 0006 (services/controller/migrations/versions/0006_one_run_table.py): a
database of revision 0005 with jobs, their metrics and sessions of every status is
upgraded to the one ``runs`` table, every row and id kept, and the REST answers of both
kinds are as before; the downgrade gives the 0005 tables back, row for row. Real SQLite
through Alembic, the real app over the upgraded database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config as AlembicConfig
from fastapi.testclient import TestClient

from services.controller.app import create_app
from services.controller.store import MIGRATIONS, Store
from tests.services.controller.fakes import FakeBackend, make_settings

JOBS = [  # id, status, log_tail
    ("job00000001", "succeeded", ""), ("job00000002", "queued", None),
    ("job00000003", "failed", "Traceback ...\nValueError: boom")]
Upgraded = tuple[str, Store, list[tuple]]
"""(url, store, the sessions rows before the upgrade)."""
SESSIONS = [  # id, status as 0005 stored it, what the REST answer says after 0006
    ("ses00000001", "queued", "queued"), ("ses00000002", "starting", "starting"),
    ("ses00000003", "ready", "ready"), ("ses00000004", "ended", "ended"),
    ("ses00000005", "failed", "failed")]


def alembic(url: str, store: Store, action: str, revision: str) -> None:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url)
    with store.engine.begin() as connection:
        cfg.attributes["connection"] = connection
        getattr(command, action)(cfg, revision)


def rows(store: Store, query: str) -> list[tuple]:
    with store.engine.begin() as connection:
        return [tuple(row) for row in connection.execute(sa.text(query))]


def fill_0005(store: Store) -> None:
    """Jobs (one with metrics) and a session of every status, as revision 0005 held them."""
    with store.engine.begin() as connection:
        for number, (job_id, status, log_tail) in enumerate(JOBS):
            connection.execute(sa.text(
                "INSERT INTO jobs (id, name, status, mode, source, config_submitted, "
                "overrides, config_resolved, output_dir, num_steps, log_tail, created_at, "
                "updated_at) VALUES (:id, 'demo', :status, 'sample_mean', 'controller', "
                "'{}', '[]', '{}', :folder, 4, :log_tail, :t, :t)"), {
                    "id": job_id, "status": status, "folder": f"/runs/{job_id}",
                    "log_tail": log_tail, "t": 100.0 + number})
        connection.execute(sa.text(
            "INSERT INTO metrics VALUES ('job00000001', 0, 1.0, '{\"reward/mean\": 0.5}')"))
        for number, (session_id, status, _) in enumerate(SESSIONS):
            connection.execute(sa.text(
                "INSERT INTO sessions VALUES (:id, :status, 'tiny', 2, '{}', '{}', :folder, "
                ":submission, :step, 100, 0.25, 0, :saved, :error, :t, :t)"), {
                    "id": session_id, "status": status, "folder": f"/sessions/{session_id}",
                    "submission": f"tally-session-{session_id}", "step": number,
                    "saved": "/saved" if status == "ended" else None,
                    "error": "boom" if status == "failed" else None, "t": 200.0 + number})


@pytest.fixture
def upgraded(tmp_path: Path) -> Iterator[Upgraded]:
    """(url, store, the sessions rows before the upgrade) of a 0005 database upgraded."""
    data = tmp_path / "data"
    data.mkdir()
    url = f"sqlite:///{data / 'controller.db'}"
    store = Store(url)
    alembic(url, store, "upgrade", "0005")
    fill_0005(store)
    before = rows(store, "SELECT * FROM sessions ORDER BY id")
    store.migrate()
    yield url, store, before
    store.close()


def test_the_upgrade_keeps_every_row_and_id_in_one_table(upgraded: Upgraded) -> None:
    _, store, _ = upgraded
    kinds = dict(rows(store, "SELECT id, kind FROM runs"))
    assert kinds == {**{j[0]: "job" for j in JOBS}, **{s[0]: "session" for s in SESSIONS}}
    assert rows(store, "SELECT id, status FROM runs WHERE kind = 'session' ORDER BY id") == [
        ("ses00000001", "queued"), ("ses00000002", "pending"), ("ses00000003", "running"),
        ("ses00000004", "succeeded"), ("ses00000005", "failed")]
    assert rows(store, "SELECT job_id, step FROM metrics") == [("job00000001", 0)]
    assert "sessions" not in sa.inspect(store.engine).get_table_names()
    ended = store.get_session("ses00000004")
    assert (ended.saved_path, ended.step, ended.tokens, ended.world_size) == ("/saved", 3, 100, 2)
    assert store.get_job("ses00000004") is None  # the jobs routes never see a session


def test_after_the_upgrade_both_kinds_answer_as_before(upgraded: Upgraded, tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    api = TestClient(app)
    jobs = api.get("/api/jobs").json()
    assert sorted(job["id"] for job in jobs["items"]) == [j[0] for j in JOBS]
    assert api.get(f"/api/jobs/{JOBS[0][0]}/metrics").json()["series"]["reward/mean"] == [0.5]
    assert api.get(f"/api/jobs/{SESSIONS[0][0]}").status_code == 404
    sessions = {s["id"]: s for s in api.get("/api/sessions").json()["items"]}
    assert {i: s["status"] for i, s in sessions.items()} == {s[0]: s[2] for s in SESSIONS}
    assert sessions["ses00000004"]["saved_path"] == "/saved"
    assert sessions["ses00000005"]["error"] == "boom"
    assert api.get(f"/api/sessions/{JOBS[0][0]}").status_code == 404


def test_the_downgrade_gives_the_0005_tables_back(upgraded: Upgraded) -> None:
    url, store, before = upgraded
    alembic(url, store, "downgrade", "0005")
    assert rows(store, "SELECT * FROM sessions ORDER BY id") == before
    assert rows(store, "SELECT id, status, log_tail FROM jobs ORDER BY id") == [
        tuple(job) for job in JOBS]
    assert rows(store, "SELECT job_id, step FROM metrics") == [("job00000001", 0)]
    assert "runs" not in sa.inspect(store.engine).get_table_names()
    store.migrate()  # and up again: nothing lost on the way
    assert len(rows(store, "SELECT id FROM runs")) == len(JOBS) + len(SESSIONS)
