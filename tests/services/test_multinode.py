"""Two Ray nodes on this machine: trainer ranks on one, rollout engines on the other; one
RL step completes and gives the same weights as the single-node run. Colocated engines
land beside the trainer ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_and_engines_on_different_nodes(tmp_path: Path) -> None:
    env = {**os.environ, "TALLY_DATA_DIR": str(tmp_path / "data"), "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run([sys.executable, "-m", "tests.services.multinode_run", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    node_a, node_b = report["nodes"]["node_a"][:8], report["nodes"]["node_b"][:8]
    assert report["split"] == (f"trainer ranks on nodes ['{node_a}', '{node_a}']; "
                               f"rollout engines on nodes ['{node_b}']")
    assert report["together"] == (f"trainer ranks on nodes ['{node_a}', '{node_a}']; "
                                  f"rollout engines on nodes ['{node_a}']")
    assert report["colocated"] == (f"trainer ranks on nodes ['{node_b}', '{node_b}']; "
                                   f"rollout engines on nodes ['{node_b}']")
    assert report["max_weight_diff"] == 0.0
