"""A job holds its own credentials only: a real embedded head (services/controller/ray_head.py)
started by a controller holding its API token, database URL and key file path, and a real
Ray job on it, whose driver and one of its Ray tasks write what they were given (variable
names, and whether any value is the master token) into the job's folder."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.controller.ray_head import LocalRayHead
from services.controller.ray_jobs import RayJobBackend
from services.controller.session_secret import KEY_FILE, controller_key

MASTER = "master-token-0123456789abcdef"
CONTROLLER_ONLY = {"TALLY_API_TOKEN": MASTER, "TALLY_DATABASE_URL": "sqlite:////tmp/c.db",
                   "TALLY_CONTROLLER_DIR": "/run/secrets/tally",
                   "TALLY_ALLOWED_ROOTS": "/data", "AWS_SECRET_ACCESS_KEY": "aws-secret"}
"""What the controller's environment holds and no job may see (the last two: anything not
on the allowlist goes, not only what Tally names)."""

REPORT = """
import json, os, sys, ray
MASTER = {master!r}
def seen():
    return {{"keys": sorted(os.environ),
             "master": any(MASTER in value for value in os.environ.values())}}
ray.init()
report = {{"driver": seen(), "task": ray.get(ray.remote(num_cpus=0)(seen).remote())}}
with open(sys.argv[1], "w") as out:
    json.dump(report, out)
"""


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    """A head started the way the controller starts it, from a controller environment."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in CONTROLLER_ONLY.items():
            env.setenv(name, value)
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        head = LocalRayHead(num_cpus=1,
                            log_path=tmp_path_factory.mktemp("ray") / "head.log")
        head.start()
    try:
        yield head
    finally:
        head.stop()


def test_a_job_and_its_tasks_hold_their_own_token_and_none_of_the_controllers(
        head: LocalRayHead, tmp_path: Path) -> None:
    script, report = tmp_path / "report.py", tmp_path / "env.json"
    script.write_text(REPORT.format(master=MASTER))
    backend = RayJobBackend(head.address)
    submission = backend.submit("tally-credentials", f"{sys.executable} {script} {report}",
                                {"TALLY_JOB_TOKEN": "own-token", "TALLY_JOB_ID": "j1"}, {})
    deadline = time.monotonic() + 120
    while (info := backend.info(submission)) is None or info.status in ("pending", "running"):
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.5)
    assert info.status == "succeeded", backend.logs(submission)
    seen = json.loads(report.read_text())
    for where in ("driver", "task"):
        keys = set(seen[where]["keys"])
        assert keys.isdisjoint(CONTROLLER_ONLY), (where, keys & set(CONTROLLER_ONLY))
        assert {"TALLY_JOB_TOKEN", "TALLY_JOB_ID", "PATH", "HOME"} <= keys, (where, keys)
        assert seen[where]["master"] is False, where


def test_the_controllers_credentials_cannot_be_handed_to_a_job() -> None:
    """Checked before any request: no Ray needed at this address."""
    backend = RayJobBackend("http://127.0.0.1:9")
    for name in ("TALLY_API_TOKEN", "TALLY_DATABASE_URL", "TALLY_CONTROLLER_DIR"):
        with pytest.raises(ValueError, match=name):
            backend.submit("tally-x", "true", {name: "x"}, {})


def test_the_controller_key_can_live_where_no_job_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On KubeRay the data folder is every Ray pod's: the key is read from the controller's
    own folder (a Secret mounted there only) and never made in the data folder."""
    own, data = tmp_path / "own", tmp_path / "data"
    own.mkdir()
    data.mkdir()
    (own / KEY_FILE).write_text("ab" * 32 + "\n")  # as `openssl rand -hex 32` writes it
    monkeypatch.setenv("TALLY_CONTROLLER_DIR", str(own))
    assert controller_key(data) == bytes.fromhex("ab" * 32)
    assert not (data / KEY_FILE).exists()
