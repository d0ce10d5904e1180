"""Bounded long reads over real HTTP on loopback (uvicorn, SQLite; Ray faked): SSE and
log-follow connections are capped per job and in all (one count for both kinds), a long
metrics backlog goes out in bounded events without losing a step, and a saved log's tail
is read from its end."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from services.cli import app as cli
from services.controller import routes_stream
from services.controller.app import create_app
from services.controller.job_files import own_log
from tests.services.controller.fakes import (
    DEMO,
    DEMO_OVERRIDES,
    FakeBackend,
    make_settings,
    serve_in_thread,
    step_rows,
)


def running_job(http: httpx.Client, app) -> dict:
    job = http.post("/api/jobs", json={"config_yaml": DEMO, "overrides": DEMO_OVERRIDES}).json()
    app.state.controller.store.transition(job["id"], "running")
    return job


def test_streams_are_capped_per_job_and_freed_on_close(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        job = running_job(http, app)
        other = running_job(http, app)
        with ExitStack() as stack:
            for _ in range(routes_stream.MAX_STREAMS_PER_JOB):
                response = stack.enter_context(http.stream("GET", f"/api/jobs/{job['id']}/events"))
                assert response.status_code == 200
            refused = http.get(f"/api/jobs/{job['id']}/events")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
            with http.stream("GET", f"/api/jobs/{other['id']}/events") as elsewhere:
                assert elsewhere.status_code == 200  # the cap is per job
        deadline = time.monotonic() + 10  # the closed streams free their slots
        while True:
            with http.stream("GET", f"/api/jobs/{job['id']}/events") as again:
                if again.status_code == 200:
                    break
            assert time.monotonic() < deadline, "closed streams kept their slots"
            time.sleep(0.2)


def in_ray(http: httpx.Client) -> str:
    """A job the controller has submitted to (fake) Ray: its log can be followed."""
    job = http.post("/api/jobs", json={"config_yaml": DEMO, "overrides": DEMO_OVERRIDES}).json()
    # A guard: the reconcile loop runs every 0.2 s, but the first submission of the file
    # once took over 60 s while the other xdist worker had this 2-core machine busy.
    deadline = time.monotonic() + 180
    while (status := http.get(f"/api/jobs/{job['id']}").json()["status"]) != "pending":
        assert time.monotonic() < deadline, f"the job never reached Ray (status {status})"
        time.sleep(0.05)
    return job["id"]


def test_log_follows_are_capped_with_the_event_streams_and_freed_on_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    per_job = routes_stream.MAX_STREAMS_PER_JOB
    monkeypatch.setattr(routes_stream, "MAX_STREAMS", per_job + 2)  # the cap in all, reachable
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        job, other = in_ray(http), in_ray(http)
        follow = {"follow": True}
        with ExitStack() as stack:
            for _ in range(per_job):
                response = stack.enter_context(
                    http.stream("GET", f"/api/jobs/{job}/logs", params=follow))
                assert response.status_code == 200
            refused = http.get(f"/api/jobs/{job}/logs", params=follow)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
            assert http.get(f"/api/jobs/{job}/events").status_code == 429  # one count
            assert http.get(f"/api/jobs/{job}/logs").status_code == 200  # a read, no stream
            shown = CliRunner().invoke(cli, ["logs", job, "-f", "--url", url])
            assert shown.exit_code == 1
            assert "error 429: too many open streams; close one and retry" in shown.output
            for _ in range(2):  # the other job has slots of its own, up to the cap in all
                response = stack.enter_context(
                    http.stream("GET", f"/api/jobs/{other}/logs", params=follow))
                assert response.status_code == 200
            assert http.get(f"/api/jobs/{other}/logs", params=follow).status_code == 429
        deadline = time.monotonic() + 30  # a guard: the closed follows free their slots
        while True:
            with http.stream("GET", f"/api/jobs/{job}/logs", params=follow) as again:
                if again.status_code == 200:
                    break
            assert time.monotonic() < deadline, "closed follows kept their slots"
            time.sleep(0.2)


def test_a_long_backlog_arrives_whole_in_bounded_events(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        job = http.post("/api/jobs", json={"config_yaml": DEMO, "overrides": [
            *DEMO_OVERRIDES, "num_steps=2500"]}).json()
        rows = step_rows(2500)
        for start in range(0, len(rows), 500):
            http.post(f"/api/jobs/{job['id']}/metrics", json={"rows": rows[start:start + 500]})
        http.post(f"/api/jobs/{job['id']}/cancel")
        steps, sizes, event = [], [], ""
        with http.stream("GET", f"/api/jobs/{job['id']}/events") as response:
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: ") and event == "metrics":
                    data = json.loads(line.removeprefix("data: "))
                    steps += data["steps"]
                    sizes.append(len(data["steps"]))
        assert steps == list(range(2500))
        assert max(sizes) == routes_stream.SSE_CHUNK


def test_a_saved_log_tail_is_read_from_the_end(tmp_path: Path) -> None:
    backend = FakeBackend()
    app = create_app(make_settings(tmp_path), backend=backend)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        job = http.post("/api/jobs", json={"config_yaml": DEMO,
                                           "overrides": DEMO_OVERRIDES}).json()
        output = "".join(f"line {i}\n" for i in range(200_000))
        (Path(job["output_dir"]) / "driver.log").write_text(output)
        # Ray held the same output: the reconciler may save its copy before Ray forgets
        # the job (then that copy is read), or not (then driver.log is): either way, the end
        deadline = time.monotonic() + 30
        while not (submitted := http.get(f"/api/jobs/{job['id']}").json()["ray_submission_id"]):
            assert time.monotonic() < deadline, "the job never reached the fake Ray"
            time.sleep(0.05)
        backend.jobs[submitted]["logs"] = output
        http.post(f"/api/jobs/{job['id']}/cancel")
        backend.jobs.clear()  # Ray forgot it: the saved copy is what is left
        assert http.get(f"/api/jobs/{job['id']}/logs", params={"tail": 3}).text == \
            "line 199997\nline 199998\nline 199999\n"
        whole = http.get(f"/api/jobs/{job['id']}/logs").text  # bounded: its last MiB only
        assert len(whole.encode()) == routes_stream.DEFAULT_TAIL_BYTES
        assert whole.endswith("line 199999\n")
        assert http.get(f"/api/jobs/{job['id']}/logs", params={"bytes": 12}).text == \
            "line 199999\n"


SIGTERM_DUMP = (  # what Ray's failure-signal handler prints when `ray job stop` stops a driver
    "*** SIGTERM received at time=1796190819 on cpu 1 ***\n"
    "PC: @     0x7ff1fe8a3f16  (unknown)  (unknown)\n"
    "    @     0x7ff1fe85a050  (unknown)  (unknown)\n"
    "[2026-12-02 05:53:39,908 E 15124 15124] logging.cc:474: *** SIGTERM received at "
    "time=1796190819 on cpu 1 ***\n"
    "[2026-12-02 05:53:39,908 E 15124 15124] logging.cc:474: PC: @     0x7ff1fe8a3f16  "
    "(unknown)  (unknown)\n"
    "[2026-12-02 05:53:39,908 E 15124 15124] logging.cc:474:     @     0x7ff1fe85a050  "
    "(unknown)  (unknown)\n")
STOPPED = "[tally: the driver was stopped (SIGTERM); its stack dump is left out]\n"


def test_a_cancelled_jobs_log_ends_without_the_sigterm_dump(tmp_path: Path) -> None:
    backend = FakeBackend()
    app = create_app(make_settings(tmp_path), backend=backend)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        job_id = in_ray(http)
        ray_job = backend.jobs[f"tally-{job_id}"]
        ray_job.update(status="running", logs="step 1/2\n")
        with http.stream("GET", f"/api/jobs/{job_id}/logs", params={"follow": True}) as live:
            chunks = live.iter_text()
            assert next(chunks) == "step 1/2\n"
            for start in range(0, len(SIGTERM_DUMP), 40):  # pieces that split the lines
                ray_job["logs"] += SIGTERM_DUMP[start:start + 40]
                time.sleep(0.03)
            assert http.post(f"/api/jobs/{job_id}/cancel").json()["status"] == "cancelled"
            assert "".join(chunks) == STOPPED
        assert http.get(f"/api/jobs/{job_id}/logs").text == "step 1/2\n" + STOPPED
        deadline = time.monotonic() + 60  # the reconcile loop saves the log Ray confirms
        saved = own_log(app.state.controller.settings, job_id)  # the controller's own copy
        while not saved.exists():
            assert time.monotonic() < deadline, "the log was never saved"
            time.sleep(0.05)
        assert saved.read_text() == "step 1/2\n" + STOPPED
