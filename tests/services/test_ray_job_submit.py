"""`ray job submit --working-dir . -- python -m services.train configs/demo.yaml` against a
real Ray head started for this test (loopback only, in a temp folder of its own, every port
picked by Ray itself and the job server's read back) and stopped after."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.controller.ray_head import TEMP_PREFIX, dashboard_address, free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def wait_for_dashboard(temp_dir: str, process: subprocess.Popen, timeout: float = 300) -> str:
    """The head's job server URL once it answers (the deadline is a guard)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}")
        url = dashboard_address(temp_dir)
        try:
            if url:
                with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                    return url
        except urllib.error.HTTPError:
            return url  # it answers (401 while token authentication is on): it is up
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the Ray dashboard of {temp_dir} did not come up")


@pytest.mark.slow
def test_ray_job_submit_runs_the_demo_config(tmp_path: Path) -> None:
    temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)  # short: Ray's socket paths live in it
    token_file = tmp_path / "ray_auth_token"
    token_file.write_text(secrets.token_hex(32))
    # Token authentication on, with this test's own token for the head and the client.
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    env.pop("RAY_ADDRESS", None)
    # --block keeps the head's processes tied to this one, so stopping it stops only them
    # (`ray stop` would stop every Ray cluster on the machine).
    # Ports: 0, Ray binds them (another Ray node on this machine may hold a default one,
    # e.g. the agent's, without which the head takes no jobs); the Ray Client server's,
    # which Ray refuses as 0, is the one chosen free.
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--port=0",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", "--dashboard-port=0",
         "--dashboard-agent-listen-port=0", f"--ray-client-server-port={free_port()}",
         f"--temp-dir={temp_dir}", "--num-cpus=4", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = wait_for_dashboard(temp_dir, head)
        runtime_env = {"env_vars": {"TALLY_DATA_DIR": str(tmp_path / "data"),
                                    "RAY_USAGE_STATS_ENABLED": "0"}}
        command = [
            str(BIN / "ray"), "job", "submit", "--address", url, "--working-dir", str(ROOT),
            "--runtime-env-json", json.dumps(runtime_env), "--",
            "python", "-m", "services.train", "configs/demo.yaml",
            "--output-dir", str(tmp_path / "job"),
            "--set", "num_steps=2", "--set", "warmup.num_steps=5",
            "--set", "rollout.global_batch_size=16", "--set", "trainer.dp_size=1"]
        deadline = time.monotonic() + 300  # a guard, polled for the agent to take the job
        while True:  # the dashboard answers before its job agent is ready: submit again
            result = subprocess.run(command, env=env, capture_output=True, text=True,
                                    timeout=300)
            if "No available agent to submit job" not in result.stderr + result.stdout:
                break
            assert time.monotonic() < deadline, "the head's job agent never came up"
            time.sleep(2)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "step 2/2" in result.stdout
        assert "succeeded" in result.stdout.lower()
        rows = (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows] == [0, 1]
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
