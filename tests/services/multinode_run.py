"""Run by test_multinode.py in its own process: a real two-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``, loopback), trainer ranks pinned to one node and rollout
engines to the other, versus everything on one node. Prints a JSON report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from safetensors.torch import load_file

from services.config import load_job_config
from tests.services.test_train import ROOT, SMALL


def run(out: Path, trainer_node: str, engine_node: str | None) -> dict:
    """engine_node None: colocate the engines with the trainer ranks."""
    from services.driver.loop import run_job

    engine = ([f"rollout.engine.resources={{{engine_node}: 1}}"] if engine_node
              else ["colocate=true"])
    config = load_job_config(ROOT / "configs" / "demo.yaml", [
        *SMALL, "num_steps=1", f"trainer.resources={{{trainer_node}: 1}}", *engine])
    run_job(config, out, log=lambda *_: None)
    placement = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "placement"]
    return {"placement": placement[-1]["message"],
            "weights": str(out / "checkpoints" / "step_00000000" / "model" /
                           "model.safetensors")}


def main(out_dir: str) -> None:
    out = Path(out_dir)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 3, "resources": {"node_a": 10}, "include_dashboard": False})
    cluster.add_node(num_cpus=3, resources={"node_b": 10})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        nodes = {next(k for k in n["Resources"] if k.startswith("node_")): n["NodeID"]
                 for n in ray.nodes() if n["Alive"]}
        split = run(out / "split", "node_a", "node_b")
        together = run(out / "together", "node_a", "node_a")
        colocated = run(out / "colocated", "node_b", None)
        a, b = load_file(split["weights"]), load_file(together["weights"])
        max_diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        print(json.dumps({"nodes": nodes, "split": split["placement"],
                          "together": together["placement"],
                          "colocated": colocated["placement"], "max_weight_diff": max_diff}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
