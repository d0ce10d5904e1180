"""Why a job failed is said once, by its driver: one ``failed`` event in events.jsonl
(services/driver/run_dir.py), which the controller and the CLI read before any log line.
The log is read only for a job that died without writing one, and an earlier run's event
in a reused folder is never taken for this job's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services import train
from services.controller.cli_support import failure_reason
from services.driver.run_dir import EVENTS_FILE, FAILED_EVENT, JOB_CONFIG_FILE, write_failure
from tests.e2e.failing_reward import PLANTED
from tests.services.controller.fakes import DEMO, DEMO_OVERRIDES, api_client

MISLEADING = "step 0 (1/2 done)\nValueError: a misleading last line of the log\n"
"""A log whose cause, scraped, would be wrong: the event must win over it."""
RAY_MESSAGE = "Job entrypoint command failed with exit code 1"


@pytest.fixture
def api(tmp_path: Path) -> TestClient:
    return api_client(tmp_path)


def submitted(api: TestClient, *overrides: str, output_dir: Path | None = None) -> dict:
    """A job the controller accepted and handed to (fake) Ray."""
    extra = [f"output_dir={output_dir}"] if output_dir else []
    response = api.post("/api/jobs", json={"config_yaml": DEMO, "overrides": [
        *DEMO_OVERRIDES, *overrides, *extra]})
    assert response.status_code == 201, response.text
    api.ctl.reconciler.tick()
    return response.json()


def ended(api: TestClient, job: dict, logs: str) -> dict:
    """Ray says the job failed with ``logs``: the controller's record of it after."""
    api.backend.finish(f"tally-{job['id']}", "failed", logs, RAY_MESSAGE)
    api.ctl.reconciler.tick()
    return api.get(f"/api/jobs/{job['id']}").json()


def failed_events(folder: Path) -> list[dict]:
    lines = (folder / EVENTS_FILE).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == FAILED_EVENT]


def test_a_failing_job_is_said_by_its_drivers_event_not_its_log(
        ray_cluster: None, api: TestClient) -> None:
    job = submitted(api, "rollout.reward.type=custom",
                    "rollout.reward.custom_function=tests.e2e.failing_reward:always_raises")
    folder = Path(job["output_dir"])
    # the driver Ray would run for this job: the controller's config file, its folder
    code = train.main([str(folder / JOB_CONFIG_FILE), "--output-dir", str(folder)])
    assert code == 1
    [event] = failed_events(folder)
    assert PLANTED in event["message"] and "\n" not in event["message"], event
    assert event["exit_code"] == 1
    record = ended(api, job, MISLEADING)  # the log Ray kept ends with another line
    assert record["error"] == f"{event['message']} (exit code 1)"
    assert failure_reason(record) == event["message"]  # the CLI says the same line


def test_without_an_event_the_cause_is_scraped_and_an_earlier_runs_event_is_ignored(
        api: TestClient) -> None:
    folder = api.ctl.settings.data_dir / "mine" / "run"
    folder.mkdir(parents=True)
    write_failure(folder, "job demo: an earlier run's failure", 1)  # before this job
    time.sleep(0.01)
    job = submitted(api, output_dir=folder)
    record = ended(api, job, MISLEADING)  # killed: no event of its own
    assert record["error"] == "ValueError: a misleading last line of the log (exit code 1)"
    assert failure_reason(record) == "ValueError: a misleading last line of the log"


def test_the_event_wins_over_the_log_and_keeps_one_line(api: TestClient) -> None:
    job = submitted(api)
    write_failure(Path(job["output_dir"]), "job demo: \x1b[31mit broke\x1b[0m\n  at step 3\n", 1)
    record = ended(api, job, MISLEADING)
    assert record["error"] == "job demo: it broke; at step 3 (exit code 1)"
    assert failure_reason(record) == "job demo: it broke; at step 3"


def test_a_refused_resume_writes_its_failed_event_with_exit_code_2(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(DEMO)
    folder = tmp_path / "job"
    folder.mkdir()
    code = train.main([str(config), "--output-dir", str(folder), "--resume",
                       str(tmp_path / "no-such-checkpoint"), *(
                           a for o in DEMO_OVERRIDES for a in ("--set", o))])
    assert code == 2
    [event] = failed_events(folder)
    assert "no-such-checkpoint" in event["message"] and event["exit_code"] == 2
