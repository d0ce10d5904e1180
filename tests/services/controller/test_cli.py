"""`tally submit / jobs / status / logs / cancel` against a live controller (Ray faked)."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app as cli
from services.controller.app import create_app
from tests.services.controller.fakes import FakeBackend, make_settings, serve_in_thread

ROOT = Path(__file__).resolve().parents[3]
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


def in_ray(backend: FakeBackend, job_id: str) -> dict:
    """The (fake) Ray job of ``job_id``, once the served controller's own reconcile loop
    has submitted it (never a second pass run beside that loop)."""
    deadline = time.monotonic() + 60  # a guard: the loop runs every 0.2 s
    while f"tally-{job_id}" not in backend.jobs:
        assert time.monotonic() < deadline, "the job never reached Ray"
        time.sleep(0.05)
    return backend.jobs[f"tally-{job_id}"]


def test_submit_list_status_logs_cancel(served) -> None:
    url, backend, _ = served
    code, out = run("submit", DEMO, "--set", "num_steps=2", "--url", url)
    assert code == 0 and out.startswith("job ") and "queued" in out
    job_id = out.split()[1]
    in_ray(backend, job_id)["logs"] = "step 1/2\nstep 2/2\n"
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


def test_logs_follow_prints_new_output_as_it_comes_until_the_job_ends(served) -> None:
    """`tally logs ID -f` (its own process): what the log holds, then each line Ray adds,
    once, while the job runs; it exits 0 when the job ends."""
    url, backend, _ = served
    code, out = run("submit", DEMO, "--set", "num_steps=3", "--url", url)
    assert code == 0, out
    job_id = out.split()[1]
    ray_job = in_ray(backend, job_id)
    ray_job.update(status="running", logs="step 1/3\n")
    follower = subprocess.Popen([sys.executable, "-m", "services.cli", "logs", job_id, "-f",
                                 "--url", url], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in follower.stdout],
                              daemon=True)
    reader.start()
    try:
        assert lines.get(timeout=120) == "step 1/3\n"  # timeouts: guards against a hang
        ray_job["logs"] += "step 2/3\n"
        assert lines.get(timeout=120) == "step 2/3\n"
        backend.finish(f"tally-{job_id}", "succeeded", ray_job["logs"] + "step 3/3\n")
        assert follower.wait(timeout=120) == 0, follower.stderr.read()
        reader.join(timeout=120)
        assert list(lines.queue) == ["step 3/3\n"]
    finally:
        follower.kill()
        follower.wait()


def test_status_of_a_failed_job_says_the_cause_once_and_exits_1(served) -> None:
    url, backend, ctl = served
    _, out = run("submit", DEMO, "--set", "num_steps=2", "--url", url)
    job_id = out.split()[1]
    logs = ("step 1/2\nTraceback (most recent call last):\n  File \"loop.py\", line 3\n"
            "\x1b[31mValueError: boom\x1b[0m\n")
    in_ray(backend, job_id).update(
        status="failed", logs=logs, message="Job entrypoint command failed with exit code 1, "
                                            "last available logs (truncated to 20,000 "
                                            "chars):\n" + logs)
    deadline = time.monotonic() + 60  # the served reconcile loop records Ray's end
    while ctl.store.get_job(job_id).status != "failed":
        assert time.monotonic() < deadline, "the end was never recorded"
        time.sleep(0.05)
    assert ctl.store.get_job(job_id).error == "ValueError: boom (exit code 1)"  # the view's
    code, out = run("status", job_id, "--url", url)
    assert code == 1 and out.count("boom") == 1, out
    assert "ValueError: boom\n" in out and "step 1/2\n" in out


def test_one_problem_of_a_submit_is_one_line(served) -> None:
    url, _, _ = served
    code, out = run("submit", DEMO, "--set", "trainer.optimizer.lrr=1", "--url", url)
    assert (code, out) == (2, "error 422: trainer.optimizer.lrr: unknown key; did you mean "
                              "lr?\n")
    code, out = run("submit", DEMO, "--set", "trainer.optimizer.lrr=1", "--set",
                    "num_stepz=2", "--url", url)
    assert code == 2 and out == ("error 422: invalid request:\n"
                                 "  trainer.optimizer.lrr: unknown key; did you mean lr?\n"
                                 "  num_stepz: unknown key; did you mean num_steps?\n")
