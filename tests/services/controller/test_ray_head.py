"""The embedded head: its job server address read back from its own log; its marker (a head
that is gone leaves no process behind). Real processes stand in for what a dead head
leaves (workers naming its temp folder); no Ray."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from services.controller.ray_head import TEMP_PREFIX, LocalRayHead, dashboard_address, processes_of

SLEEPER = "import sys, time; time.sleep(300)"


def leftover(temp_dir: str) -> subprocess.Popen[bytes]:
    """A process whose command line names the head's temp folder, as its workers' do."""
    return subprocess.Popen([sys.executable, "-c", SLEEPER, f"--temp-dir={temp_dir}"])


def test_a_dead_heads_leftovers_are_killed_and_its_marker_and_folder_removed(
        tmp_path: Path) -> None:
    temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # the head's `ray start` process: gone
    orphans = [leftover(temp_dir), leftover(temp_dir)]
    stranger = subprocess.Popen([sys.executable, "-c", SLEEPER])  # not the head's: kept
    try:
        deadline = time.monotonic() + 10
        while len(processes_of(temp_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        marker = tmp_path / "ray-head.json"
        marker.write_text(json.dumps({"pid": dead.pid, "address": "http://127.0.0.1:9",
                                      "temp_dir": temp_dir}))
        assert LocalRayHead(marker=marker).adopt() is False
        for orphan in orphans:
            assert orphan.wait(timeout=10) is not None
        assert processes_of(temp_dir) == [] and not Path(temp_dir).exists()
        assert not marker.exists() and psutil.pid_exists(stranger.pid)
        assert stranger.poll() is None
    finally:
        for proc in (*orphans, stranger):
            proc.kill()
            proc.wait()


def test_an_unreadable_marker_is_dropped(tmp_path: Path) -> None:
    marker = tmp_path / "ray-head.json"
    marker.write_text("{not json")
    assert LocalRayHead(marker=marker).adopt() is False and not marker.exists()


def test_the_job_server_address_is_read_from_the_heads_own_dashboard_log(
        tmp_path: Path) -> None:
    """The head binds its job server on a port Ray picks (``--dashboard-port=0``): the
    address is what its dashboard logs, in its own temp folder (not another head's)."""
    assert dashboard_address(tmp_path) == ""  # not started yet
    logs = tmp_path / "session_2026-01-01_00-00-00_000000_1" / "logs"
    logs.mkdir(parents=True)
    (tmp_path / "session_latest").symlink_to(logs.parent)
    (logs / "dashboard.log").write_text("INFO head.py:160 -- Starting dashboard head\n")
    assert dashboard_address(tmp_path) == ""  # not listening yet
    with (logs / "dashboard.log").open("a") as log:
        log.write("INFO http_server_head.py:492 -- Dashboard head http address: "
                  "127.0.0.1:38173\nINFO http_server_head.py:498 -- <ResourceRoute ...>\n")
    assert dashboard_address(tmp_path) == "http://127.0.0.1:38173"
