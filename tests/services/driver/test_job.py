"""Where a job's actors go on one node: the placement strategy of ``trainer.allow_cross_node``
(services/runtime/placement.py for a job's group, trainer/group.py for a group of ranks alone).
Ranks on two nodes — the refusal after placement, PACK spreading them — need a second
node: tests/e2e/test_multinode.py's cluster."""

from __future__ import annotations

import pytest
from ray.util.placement_group import placement_group_table, remove_placement_group

from services.config.job import load_job_config
from services.runtime.placement import reserve_job
from tests.services.controller.fakes import DEMO_OVERRIDES
from tests.services.driver.clean_run import ROOT
from trainer.group import TrainerGroup


def demo(*overrides: str):
    return load_job_config(ROOT / "configs" / "demo.yaml",
                           [*DEMO_OVERRIDES, "trainer.dp_size=2", *overrides])


# With engine bundles in the job's group Ray has one strategy for all of it, so the ranks'
# one node cannot be asked as STRICT_PACK: PACK, and the ranks' nodes are checked once
# placed. Colocated engines add no bundle: the ranks alone, STRICT_PACK unless allowed.
@pytest.mark.parametrize(("overrides", "strategy"), [
    ([], "PACK"),
    (["trainer.allow_cross_node=true"], "PACK"),
    (["colocate=true"], "STRICT_PACK"),
    (["colocate=true", "trainer.allow_cross_node=true"], "PACK"),
])
def test_a_job_asks_one_node_for_its_ranks_unless_allow_cross_node(
        ray_cluster: None, overrides: list[str], strategy: str) -> None:
    config = demo(*overrides)
    placed = reserve_job(config, on_wait=lambda _message: None, timeout_s=120)
    try:
        table = placement_group_table(placed.group)
        assert table["strategy"] == strategy
        assert len(table["bundles"]) == (2 if "colocate=true" in overrides else 3)
        assert len(set(table["bundles_to_node_id"].values())) == 1
    finally:
        remove_placement_group(placed.group)


@pytest.mark.parametrize(("allow", "strategy"), [(False, "STRICT_PACK"), (True, "PACK")])
def test_a_group_of_ranks_alone_asks_one_node_unless_allow_cross_node(
        ray_cluster: None, allow: bool, strategy: str) -> None:
    config = demo(f"trainer.allow_cross_node={str(allow).lower()}").trainer
    group = TrainerGroup._place(config)  # what TrainerGroup(..., placement=None) reserves
    try:
        assert placement_group_table(group)["strategy"] == strategy
    finally:
        remove_placement_group(group)


def test_the_driver_loop_computes_on_one_thread_and_gives_the_callers_back() -> None:
    import torch

    from services.driver.job import driver_threads

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="a step failed"), driver_threads():
        assert torch.get_num_threads() == 1
        raise RuntimeError("a step failed")
    assert torch.get_num_threads() == before


def test_the_reuse_key_tells_gangs_whose_bundles_look_alike_by_their_role_counts() -> None:
    """A later job may take a parked gang only where the key (services/driver/job.py) is
    equal: the same shape with another learning rate or seed is; 2 ranks and 1 engine
    against 1 rank and 2 engines, all of one CPU (equal bundle lists), are not; the
    colocated path and a critic of another world size have a key of their own or none."""
    from services.driver.job import reuse_key
    from services.runtime.placement import job_bundles

    one_cpu = ["trainer.num_cpus_per_rank=1", "rollout.engine.num_cpus=1"]
    two_ranks = demo(*one_cpu, "rollout.engine.num_engines=1")
    two_engines = demo(*one_cpu, "trainer.dp_size=1", "rollout.engine.num_engines=2")
    assert job_bundles(two_ranks) == job_bundles(two_engines)
    assert reuse_key(two_ranks) != reuse_key(two_engines)
    assert reuse_key(demo()) == reuse_key(demo("trainer.optimizer.lr=1e-3", "rollout.seed=3"))
    assert reuse_key(demo("colocate=true")) is None
    critic = ["rollout.advantage={type: gae, lam: 0.9}", "critic.enabled=true"]
    assert reuse_key(demo(*critic)) not in (None, reuse_key(demo()),
                                            reuse_key(demo(*critic, "critic.dp_size=1")))
