"""A real Ray cluster on this machine, in its own process (multinode_run.py). On the head
alone (two CPUs): gang placement, a job's bundles reserved all at once or not at all, and
one that does not fit waits holding nothing and says what it misses. With a second node:
trainer ranks on one, rollout engines on the other; one RL step completes and gives the
same weights as the colocated run, whose engines land beside the trainer ranks on one node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("multinode")
    # The session's data folder where there is one (tests/conftest.py): the demo's warm
    # start, computed once, is shared.
    data_dir = os.environ.get("TALLY_DATA_DIR") or str(tmp_path / "data")
    env = {**os.environ, "TALLY_DATA_DIR": data_dir, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run([sys.executable, "-m", "tests.e2e.multinode_run", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_job_waits_holding_nothing_then_fits(report: dict) -> None:
    gang = report["gang"]
    assert gang["free_while_held"] == pytest.approx(0.75)
    assert gang["said"] == ["waiting for resources: needs 1.25 CPU, cluster has 0.75 free"]
    assert "cannot place the job within 2 s" in gang["refused"]
    assert gang["free_after_refusal"] == pytest.approx(0.75)  # it held nothing
    assert gang["engine_bundle"] == 1


@pytest.mark.slow
def test_trainer_and_engines_on_different_nodes(report: dict) -> None:
    node_a, node_b = report["nodes"]["node_a"][:8], report["nodes"]["node_b"][:8]
    assert report["split"] == (f"trainer ranks on nodes ['{node_b}', '{node_b}']; "
                               f"rollout engines on nodes ['{node_a}']")
    assert report["colocated"] == (f"trainer ranks on nodes ['{node_a}', '{node_a}']; "
                                   f"rollout engines on nodes ['{node_a}']")
    assert report["max_weight_diff"] == 0.0
