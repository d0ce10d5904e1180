"""The README's four-mode sweep on a two-CPU Ray head with the default max_running_jobs (the
suite's one sweep on real Ray): every job reserves its trainer rank and engine in one
placement group, so the jobs take turns instead of each holding half of what another
needs; all four succeed, and the sweep's metrics hold each mode's run. A job too big for
the whole cluster fails at once, saying what it needs and what the cluster has."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from itertools import pairwise

import httpx
import pytest

from tests.services.controller.fakes import DEMO_OVERRIDES
from tests.services.controller.test_ray import (
    ROOT,
    ControllerProcess,
    controller_on_own_head,
    wait_job,
)

MODES = ["sample_mean", "token_mean", "prompt_mean", "constant"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_cpu_controller(tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[ControllerProcess]:
    with controller_on_own_head(tmp_path_factory, 2,
                                {"TALLY_MAX_RUNNING_JOBS": None}) as proc:  # the default
        yield proc


def tally(url: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "services.cli", *args, "--url", url],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_four_mode_sweep_on_two_cpus_and_a_job_that_cannot_fit(
        two_cpu_controller: ControllerProcess) -> None:
    url = two_cpu_controller.url
    sets = [arg for o in DEMO_OVERRIDES for arg in ("--set", o)]
    big = tally(url, "submit", "configs/demo.yaml", *sets, "--set", "trainer.dp_size=3",
                "--set", "name=too-big").split()[1]  # 3 ranks + 1 engine: 2.75 CPU of 2
    printed = tally(url, "submit", "configs/demo.yaml", "--sweep-modes", ",".join(MODES), *sets)
    job_ids = [line.split()[0] for line in printed.splitlines()[:4]]
    assert [line.split()[1] for line in printed.splitlines()[:4]] == MODES
    jobs = [wait_job(url, job_id, ("succeeded",), timeout_s=600) for job_id in job_ids]
    assert all(job["last_step"] == 1 for job in jobs)
    (sweep_id,) = {job["sweep_id"] for job in jobs}
    assert httpx.get(f"{url}/api/sweeps/{sweep_id}").json()["status"] == "succeeded"
    runs = httpx.get(f"{url}/api/sweeps/{sweep_id}/metrics").json()["runs"]
    assert [r["label"] for r in runs] == MODES and [r["mode"] for r in runs] == MODES
    for run in runs:  # each run's own objective, every step
        assert run["steps"] == [0, 1] and None not in run["series"]["pg_loss"]
        assert None not in run["series"][f"pg_loss/{run['mode']}"]
    spans = sorted((job["started_at"], job["finished_at"]) for job in jobs)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(spans)), spans
    waited = [e["message"] for job_id in job_ids
              for e in httpx.get(f"{url}/api/jobs/{job_id}").json()["events"]
              if e["kind"] == "waiting"]
    assert "waiting for resources: needs 1.25 CPU, cluster has 0.75 free" in waited
    refused = httpx.get(f"{url}/api/jobs/{big}").json()
    assert refused["status"] == "failed" and refused["error"].startswith(
        "the job can never fit this Ray cluster: it needs 2.75 CPU, the cluster has 2 CPU")

