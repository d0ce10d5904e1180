"""Where a job's actors go: one placement group holds the whole job (gang placement).

    bundles  [rank 0 … rank W-1 | engine 0 … engine E-1]     (engines colocated: ranks only)
              trainer ranks        rollout engines            rollout manager: bundle 0, 0 CPU

Ray reserves a placement group's bundles all at once or not at all, so a job that does
not fit waits holding nothing, and two jobs can never each hold half of what the other
needs. While it waits, the job writes a ``waiting`` event ("waiting for resources: needs
1.5 CPU, cluster has 0.5 free"). With ``colocate: true`` an engine runs inside a rank's
bundle (on its node and device). Trainer ranks must share one node unless
``trainer.allow_cross_node``; with engine bundles in the group that is checked once the
group is placed (Ray has one strategy per group).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.engines import engine_actor_options
from services.config import JobConfig

if TYPE_CHECKING:  # Ray is imported where a group is made: the controller counts needs only
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

POLL_S = 5.0
"""How often a waiting job looks again (and refreshes its event when the numbers change)."""


SMALL_HIDDEN_SIZE = 256
"""Below this hidden size a matrix product is too small to split across threads: one
thread is faster (the tiny model, 128 rows of one rollout: 0.036 s on one thread, 0.053 s
on two)."""


def phase_threads(config: JobConfig, model_path: str, cores: int | None = None
                  ) -> tuple[int, int]:
    """Intra-op threads on CPU of (each engine, each trainer rank); set values win.

    Synchronous (``rollout.async_steps: 0``) generation and training take turns, so each
    phase has every core of the node: the engines split them, and so do the ranks. With
    the async pipeline both run at once and each actor keeps to its Ray CPU share (at
    least one thread). A model narrower than SMALL_HIDDEN_SIZE runs on one thread.
    """
    cores = cores or len(os.sched_getaffinity(0))
    engine_share = getattr(config.rollout.engine, "num_cpus", 1.0)
    if config.rollout.async_steps:
        engine, rank = engine_share, config.trainer.num_cpus_per_rank
    else:
        engine = cores / config.rollout.engine.num_engines
        rank = cores / config.trainer.world_size
    if _hidden_size(model_path) < SMALL_HIDDEN_SIZE:
        engine = rank = 1
    engine_threads = getattr(config.rollout.engine, "num_threads", None)
    return (engine_threads or max(1, int(engine)),
            config.trainer.num_threads or max(1, int(rank)))


def _hidden_size(model_path: str) -> int:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("hidden_size") or config.get("n_embd") or 0)


def trainer_bundle(config: JobConfig) -> dict[str, float]:
    """One trainer rank's bundle (``TrainerConfig.rank_bundle``)."""
    return config.trainer.rank_bundle


def engine_bundle(config: JobConfig) -> dict[str, float]:
    """One engine's own bundle; empty when colocated or when it needs nothing (SGLang
    servers reached by URL)."""
    if config.colocate:
        return {}
    options = engine_actor_options(config.rollout.engine)
    bundle = {"CPU": options["num_cpus"], "GPU": options["num_gpus"],
              **options.get("resources", {})}
    return {name: amount for name, amount in bundle.items() if amount}


def job_bundles(config: JobConfig) -> list[dict[str, float]]:
    """Every bundle of the job, trainer ranks first."""
    engines = engine_bundle(config)
    return ([dict(trainer_bundle(config)) for _ in range(config.trainer.world_size)]
            + ([dict(engines) for _ in range(config.rollout.engine.num_engines)]
               if engines else []))


def job_needs(config: JobConfig) -> dict[str, float]:
    """The job's total resources (what the controller's admission counts)."""
    total: dict[str, float] = {}
    for bundle in job_bundles(config):
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def describe_shortfall(needs: dict[str, float], free: dict[str, float],
                       what: str = "free") -> str:
    """'needs 1.5 CPU, cluster has 0.5 free' over the resources that fall short (all of
    them when none does: a placement constraint, e.g. one node, is what is missing)."""
    short = [name for name in sorted(needs) if needs[name] > free.get(name, 0.0) + 1e-9]
    names = short or sorted(needs)
    need = ", ".join(f"{needs[n]:g} {n}" for n in names)
    have = ", ".join(f"{free.get(n, 0.0):g}" + (f" {n}" if len(names) > 1 else "")
                     for n in names)
    return f"waiting for resources: needs {need}, cluster has {have} {what}"


@dataclass
class JobPlacement:
    """The job's placement group and the Ray options of each of its actors."""

    group: PlacementGroup
    world_size: int
    num_engines: int
    colocate: bool
    has_engine_bundles: bool
    engine_options: list[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.engine_options = [self._engine(rank) for rank in range(self.num_engines)]

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)

    def _engine(self, rank: int) -> dict[str, Any]:
        if self.colocate:
            return {"num_cpus": 0, "num_gpus": 0, "resources": {},
                    "scheduling_strategy": self.strategy(rank % self.world_size)}
        if not self.has_engine_bundles:
            return {}
        return {"scheduling_strategy": self.strategy(self.world_size + rank)}

    def manager_options(self) -> dict[str, Any]:
        """The rollout manager (0 CPU) lives in bundle 0: it starts with the job."""
        return {"scheduling_strategy": self.strategy(0)}


def reserve_job(config: JobConfig, on_wait: Callable[[str], None] = print,
                timeout_s: float | None = None) -> JobPlacement:
    """Reserve every bundle of the job in one placement group; wait (holding nothing) up
    to ``timeout_s`` (default ``trainer.call_timeout_s``), reporting through ``on_wait``."""
    import ray
    from ray.util.placement_group import (
        placement_group,
        placement_group_table,
        remove_placement_group,
    )

    bundles = job_bundles(config)
    has_engines = len(bundles) > config.trainer.world_size
    one_node = not config.trainer.allow_cross_node
    strategy = "STRICT_PACK" if one_node and not has_engines else "PACK"
    timeout_s = config.trainer.call_timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    needs, said = job_needs(config), ""
    group = placement_group(bundles, strategy=strategy)
    placed = group.ready()
    while True:
        ready, _ = ray.wait([placed], timeout=min(POLL_S, timeout_s))
        if ready:
            break
        message = describe_shortfall(needs, ray.available_resources())
        if message != said:
            on_wait(message)
            said = message
        if time.monotonic() > deadline:
            remove_placement_group(group)
            raise RuntimeError(f"the cluster cannot place the job within {timeout_s:.0f} s "
                               f"({message.removeprefix('waiting for resources: ')})")
    if one_node and has_engines:
        nodes = placement_group_table(group)["bundles_to_node_id"]
        if len({nodes[i] for i in range(config.trainer.world_size)}) > 1:
            remove_placement_group(group)
            raise RuntimeError(f"trainer: the cluster cannot place {config.trainer.world_size}"
                               f" ranks of {trainer_bundle(config)} on one node")
    return JobPlacement(group, config.trainer.world_size, config.rollout.engine.num_engines,
                        config.colocate, has_engines)
