"""`ray job submit --working-dir . -- python -m services.train configs/demo.yaml` against a
real Ray head started for this test (loopback only) and stopped after."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def wait_for_dashboard(url: str, process: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers (401 while token authentication is on): it is up
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"Ray dashboard at {url} did not come up")


def test_ray_job_submit_runs_the_demo_config(tmp_path: Path) -> None:
    gcs_port, dashboard_port = free_port(), free_port()
    token_file = tmp_path / "ray_auth_token"
    token_file.write_text(secrets.token_hex(32))
    # Token authentication on, with this test's own token for the head and the client.
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    env.pop("RAY_ADDRESS", None)
    # --block keeps the head's processes tied to this one, so stopping it stops only them
    # (`ray stop` would stop every Ray cluster on the machine).
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs_port}",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard_port}", "--num-cpus=4", "--disable-usage-stats",
         # Another Ray node on this machine (the session's test cluster) may hold the
         # agent's default port; without its agent the head cannot take jobs.
         f"--dashboard-agent-listen-port={free_port()}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        wait_for_dashboard(url, head)
        runtime_env = {"env_vars": {"TALLY_DATA_DIR": str(tmp_path / "data"),
                                    "RAY_USAGE_STATS_ENABLED": "0"}}
        command = [
            str(BIN / "ray"), "job", "submit", "--address", url, "--working-dir", str(ROOT),
            "--runtime-env-json", json.dumps(runtime_env), "--",
            "python", "-m", "services.train", "configs/demo.yaml",
            "--output-dir", str(tmp_path / "job"),
            "--set", "num_steps=2", "--set", "warmup.num_steps=5",
            "--set", "rollout.global_batch_size=16", "--set", "trainer.dp_size=1"]
        for _ in range(12):  # the dashboard answers before its job agent is ready
            result = subprocess.run(command, env=env, capture_output=True, text=True,
                                    timeout=300)
            if "No available agent to submit job" not in result.stderr + result.stdout:
                break
            time.sleep(5)
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
