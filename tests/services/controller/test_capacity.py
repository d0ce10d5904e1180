"""Admission by cluster capacity (services/controller/capacity.py): a queued job goes to Ray
only when the cluster can hold its whole placement group; one that waits says why in its
events, on the API and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from services.cli import app as cli_app
from services.controller.app import create_app
from tests.services.controller.fakes import (
    DEMO,
    DEMO_OVERRIDES,
    FakeBackend,
    make_settings,
    serve_in_thread,
)


@pytest.fixture
def api(tmp_path: Path):
    backend = FakeBackend()
    backend.usage = {"CPU": (0.0, 2.0)}  # an idle two-CPU cluster
    app = create_app(make_settings(tmp_path, max_running_jobs=4), backend=backend)
    client = TestClient(app)
    client.backend = backend  # type: ignore[attr-defined]
    client.ctl = app.state.controller  # type: ignore[attr-defined]
    return client


def submit(api: TestClient, *overrides: str) -> str:
    response = api.post("/api/jobs", json={"config_yaml": DEMO,
                                           "overrides": [*DEMO_OVERRIDES, *overrides]})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def status(api: TestClient, job_id: str) -> str:
    return api.get(f"/api/jobs/{job_id}").json()["status"]


def waiting(api: TestClient, job_id: str) -> list[str]:
    return [e["message"] for e in api.get(f"/api/jobs/{job_id}").json()["events"]
            if e["kind"] == "waiting"]


def test_jobs_start_as_the_cluster_frees_up_and_a_job_too_big_fails_at_once(
        api: TestClient) -> None:
    big = submit(api, "trainer.dp_size=3")  # 3 ranks + 1 engine: 2.75 CPU of 2
    first, second = submit(api), submit(api)  # 1.25 CPU each
    api.ctl.reconciler.tick()
    assert [status(api, j) for j in (big, first, second)] == ["failed", "pending", "queued"]
    error = api.get(f"/api/jobs/{big}").json()["error"]
    assert error.startswith("the job can never fit this Ray cluster: it needs 2.75 CPU, the "
                            "cluster has 2 CPU in all; lower trainer.num_cpus_per_rank")
    assert waiting(api, second) == ["waiting for resources: needs 1.25 CPU, cluster has "
                                    "0.75 free"]
    api.ctl.reconciler.tick()  # the same message is written once
    assert len(waiting(api, second)) == 1
    api.backend.usage = {"CPU": (1.25, 2.0)}  # Ray now holds the first job's group
    api.ctl.reconciler.tick()
    assert status(api, second) == "queued"
    api.backend.finish(f"tally-{first}", "succeeded")
    api.backend.usage = {"CPU": (0.0, 2.0)}
    api.ctl.reconciler.tick()
    assert status(api, first) == "succeeded"
    api.ctl.reconciler.tick()
    assert status(api, second) == "pending"


def test_on_an_autoscaling_cluster_a_job_too_big_waits_and_never_blocks(
        api: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """TALLY_CLUSTER_AUTOSCALES: the alive nodes are not all the cluster will have."""
    monkeypatch.setenv("TALLY_CLUSTER_AUTOSCALES", "1")
    big, small = submit(api, "trainer.dp_size=3"), submit(api)
    api.ctl.reconciler.tick()
    assert [status(api, j) for j in (big, small)] == ["queued", "pending"]
    assert waiting(api, big) == ["waiting for resources: needs 2.75 CPU, cluster has 2 in all"]


def test_the_first_waiting_job_holds_the_queue(api: TestClient) -> None:
    """First come, first served: a small job never overtakes a waiting one that fits an
    empty cluster (no starvation of big jobs)."""
    api.backend.usage = {"CPU": (1.5, 3.0)}
    medium = submit(api, "trainer.dp_size=2")  # 2 CPU: fits 3, not the 1.5 free
    small = submit(api, "colocate=true")  # 0.75 CPU: would fit
    api.ctl.reconciler.tick()
    assert [status(api, j) for j in (medium, small)] == ["queued", "queued"]
    assert waiting(api, small) == []


def test_unknown_capacity_admits_by_max_running_jobs(api: TestClient) -> None:
    api.backend.usage = None
    jobs = [submit(api) for _ in range(5)]
    api.ctl.reconciler.tick()
    assert [status(api, j) for j in jobs] == ["pending"] * 4 + ["queued"]


def test_cli_status_shows_what_a_job_waits_for(api: TestClient) -> None:
    api.backend.usage = {"CPU": (1.0, 2.0)}
    busy = submit(api)  # 1.25 CPU: fits the cluster, not the 1 free
    api.ctl.reconciler.tick()
    with serve_in_thread(api.app) as url:
        result = CliRunner().invoke(cli_app, ["status", busy, "--url", url])
    assert result.exit_code == 0, result.output
    assert "waiting:            resources: needs 1.25 CPU, cluster has 1 free" in result.output


HOLD = """import time
import ray
from ray.util.placement_group import placement_group

ray.init()
group = placement_group([{"CPU": 1}, {"CPU": 0.5}])
ray.get(group.ready())


@ray.remote(num_cpus=0.5)
class Outside:
    def ping(self):
        return 1


@ray.remote
class Free:  # no resources held while it lives
    def ping(self):
        return 1


actors = [Outside.remote(), Free.remote()]
ray.get([a.ping.remote() for a in actors])
print("holding", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_ray_backend_reads_what_a_real_cluster_holds(tmp_path: Path) -> None:
    """RayJobBackend.resources on a real head (Ray's state API): the totals, then a
    placement group's bundles and an actor outside any group as used."""
    import sys
    import time

    from ray.job_submission import JobSubmissionClient

    from services.controller.ray_head import LocalRayHead
    from services.controller.ray_jobs import BackendUnavailable, RayJobBackend

    head = LocalRayHead(num_cpus=3, log_path=tmp_path / "head.log")
    address = head.start()
    try:
        backend = RayJobBackend(address)
        deadline = time.monotonic() + 60
        while True:  # a head just started has not reported its node yet: "unavailable"
            try:
                assert backend.resources() == {"CPU": (0.0, 3.0)}
                break
            except BackendUnavailable:
                assert time.monotonic() < deadline, "Ray never reported its node"
                time.sleep(0.5)
        script = tmp_path / "hold.py"
        script.write_text(HOLD)
        client = JobSubmissionClient(address)
        submission = client.submit_job(entrypoint=f"{sys.executable} {script}")
        deadline = time.monotonic() + 120
        while "holding" not in (client.get_job_logs(submission) or ""):
            assert not client.get_job_status(submission).is_terminal(), \
                client.get_job_logs(submission)
            assert time.monotonic() < deadline, "the job never held its resources"
            time.sleep(0.5)
        assert backend.resources() == {"CPU": (2.0, 3.0)}  # 1 + 0.5 in the group, 0.5 outside
        client.stop_job(submission)
    finally:
        head.stop()
