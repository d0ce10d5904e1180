"""The Ray job server down, through the real client (``RayJobBackend`` on Ray's own
``JobSubmissionClient`` and state API) against a loopback port that refuses connections:
every call says ``BackendUnavailable`` and names the address, and the controller rides it
out (jobs keep their status, a cancel is 503, logs come from the saved copy). A job server
that goes away after the client was created: test_controller_restart.py."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.controller.app import create_app
from services.controller.ray_jobs import BackendUnavailable, RayJobBackend
from tests.services.controller.fakes import DEMO, DEMO_OVERRIDES, make_settings, refusing_url


def test_every_call_to_an_unreachable_job_server_is_backend_unavailable() -> None:
    with refusing_url() as address:
        backend = RayJobBackend(address)

        async def first_chunk() -> str:
            return await anext(aiter(backend.follow("tally-x")))

        calls = {"info": lambda: backend.info("tally-x"),
                 "stop": lambda: backend.stop("tally-x"),
                 "logs": lambda: backend.logs("tally-x"),
                 "submit": lambda: backend.submit("tally-x", "true", {}, {}),
                 "find_submission": lambda: backend.find_submission("01000000", 1),
                 "resources": backend.resources,
                 "follow": lambda: asyncio.run(first_chunk())}
        for name, call in calls.items():
            with pytest.raises(BackendUnavailable, match=re.escape(f"Ray job server {address}")):
                call()
                pytest.fail(f"{name} did not raise")


def test_the_controller_rides_out_a_down_job_server(tmp_path: Path) -> None:
    with refusing_url() as address:
        app = create_app(make_settings(tmp_path), backend=RayJobBackend(address))
        api, ctl = TestClient(app), app.state.controller
        body = {"config_yaml": DEMO, "overrides": DEMO_OVERRIDES}
        queued = api.post("/api/jobs", json=body).json()
        running = api.post("/api/jobs", json=body).json()  # Ray ran it when it went down
        ctl.store.update_run(running["id"], ray_submission_id=f"tally-{running['id']}")
        ctl.store.transition(running["id"], "running")
        (Path(running["output_dir"]) / "driver.log").write_text("step 1/2\n")
        ctl.reconciler.tick()
        ctl.reconciler.tick()
        assert ctl.reconciler.errors >= 2
        assert api.get(f"/api/jobs/{queued['id']}").json()["status"] == "queued"  # waits
        assert api.get(f"/api/jobs/{running['id']}").json()["status"] == "running"  # not lost
        cancel = api.post(f"/api/jobs/{running['id']}/cancel")
        assert cancel.status_code == 503 and "cannot reach Ray to stop the job" in cancel.text
        assert api.get(f"/api/jobs/{running['id']}").json()["status"] == "running"
        assert api.get(f"/api/jobs/{running['id']}/logs").text == "step 1/2\n"
        assert api.post(f"/api/jobs/{queued['id']}/cancel").json()["status"] == "cancelled"
