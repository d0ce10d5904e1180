"""Run by test_multinode.py in its own process: a real Ray cluster on this machine
(``ray.cluster_utils.Cluster``, loopback). First the head alone, two CPUs: gang placement
(a job's bundles are reserved all at once or not at all; one that does not fit waits
holding nothing and says what it misses). Then a second node: trainer ranks pinned to one
node and rollout engines to the other, versus everything colocated on one node. Prints a JSON
report."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from safetensors.torch import load_file

from services.config.job import load_job_config
from tests.services.controller.fakes import DEMO_OVERRIDES
from tests.services.test_train import ROOT, SMALL


def free_cpus(expected: float) -> float:
    """The free CPUs once Ray's resource view says ``expected`` (it follows a placement a
    moment later), or what it says at the deadline (a guard)."""
    deadline = time.monotonic() + 60
    while (free := ray.available_resources().get("CPU", 0.0)) != expected:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return free


def gang_placement() -> dict:
    """On two CPUs: a demo job (0.75 + 0.5 CPU) placed; a second waits, holding nothing,
    and gives up at its timeout; once the first is gone it fits."""
    from ray.util.placement_group import remove_placement_group

    from services.runtime.placement import reserve_job

    demo = load_job_config(ROOT / "configs" / "demo.yaml", DEMO_OVERRIDES)
    first = reserve_job(demo, on_wait=lambda _: None, timeout_s=120)  # fits: placed
    held = free_cpus(0.75)
    said: list[str] = []
    try:
        reserve_job(demo, on_wait=said.append, timeout_s=2)
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    after = free_cpus(0.75)
    remove_placement_group(first.group)
    second = reserve_job(demo, on_wait=lambda _: None, timeout_s=120)
    index = second.engine_options[0]["scheduling_strategy"].placement_group_bundle_index
    remove_placement_group(second.group)
    return {"free_while_held": held, "said": said,
            "refused": refused, "free_after_refusal": after, "engine_bundle": index}


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
            "weights": str(out / "final_model" / "model.safetensors")}


def main(out_dir: str) -> None:
    out = Path(out_dir)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 10}, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        gang = gang_placement()  # the head alone: two CPUs
        cluster.add_node(num_cpus=3, resources={"node_b": 10})
        cluster.wait_for_nodes()
        nodes = {next(k for k in n["Resources"] if k.startswith("node_")): n["NodeID"]
                 for n in ray.nodes() if n["Alive"]}
        split = run(out / "split", "node_b", "node_a")
        colocated = run(out / "colocated", "node_a", None)  # all on one node, shared bundles
        a, b = load_file(split["weights"]), load_file(colocated["weights"])
        max_diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        print(json.dumps({"gang": gang, "nodes": nodes, "split": split["placement"],
                          "colocated": colocated["placement"], "max_weight_diff": max_diff}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
