"""`tally submit / jobs / status / logs / cancel` against a live controller (Ray faked)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app as cli
from services.controller.app import create_app
from tests.services.controller_fakes import FakeBackend, make_settings, serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo.yaml")


@pytest.fixture
def served(tmp_path: Path):
    backend = FakeBackend()
    app = create_app(make_settings(tmp_path), backend=backend)
    with serve_in_thread(app) as url:
        yield url, backend, app.state.controller


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_submit_list_status_logs_cancel(served) -> None:
    url, backend, ctl = served
    code, out = run("submit", DEMO, "--set", "num_steps=2", "--url", url)
    assert code == 0 and out.startswith("job ") and "queued" in out
    job_id = out.split()[1]
    ctl.reconciler.tick()
    backend.jobs[f"tally-{job_id}"]["logs"] = "step 1/2\nstep 2/2\n"
    code, out = run("jobs", "--url", url)
    assert code == 0 and job_id in out and "pending" in out
    code, out = run("status", job_id, "--url", url)
    assert code == 0 and "mode:" in out and "0/2" in out
    code, out = run("logs", job_id, "--tail", "1", "--url", url)
    assert code == 0 and out == "step 2/2\n"
    code, out = run("cancel", job_id, "--url", url)
    assert code == 0 and out.strip() == f"job {job_id} cancelled"


def test_submit_a_sweep_of_modes(served) -> None:
    url, _, _ = served
    code, out = run("submit", DEMO, "--url", url, "--sweep-modes",
                    "sample_mean,token_mean,prompt_mean,constant")
    assert code == 0 and out.count("\n") == 5 and "/sweeps/" in out


def test_errors_name_the_field_and_exit_nonzero(served, tmp_path: Path) -> None:
    url, _, _ = served
    code, out = run("submit", DEMO, "--set", "trainer.optimizer.learning_rate=1", "--url", url)
    assert code == 2 and "trainer.optimizer.learning_rate: unknown key" in out
    code, out = run("status", "nope", "--url", url)
    assert code == 1 and "no job nope" in out
    code, out = run("jobs", "--url", "http://127.0.0.1:9")
    assert code == 1 and "cannot reach the controller" in out
