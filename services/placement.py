"""Where a job's actors go. Trainer ranks get one placement group (trainer/group.py);
rollout engines get bundles of their own, or share the ranks' bundles when
``colocate: true`` (the engine then runs beside a rank, on its node and device)."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout.engines import engine_actor_options
from services.config import JobConfig


def engine_placement(config: JobConfig, trainer_group: PlacementGroup
                     ) -> tuple[list[dict[str, Any]], PlacementGroup | None]:
    """Ray options per engine actor, and the engines' own placement group (if any)."""
    engine = config.rollout.engine
    world_size = config.trainer.world_size
    if config.colocate:
        return [{"num_cpus": 0, "num_gpus": 0, "resources": {},
                 "scheduling_strategy": PlacementGroupSchedulingStrategy(
                     trainer_group, placement_group_bundle_index=rank % world_size)}
                for rank in range(engine.num_engines)], None
    options = engine_actor_options(engine)
    bundle = {"CPU": options["num_cpus"], "GPU": options["num_gpus"],
              **options.get("resources", {})}
    bundle = {name: amount for name, amount in bundle.items() if amount}
    if not bundle:  # nothing to reserve (e.g. SGLang servers reached by URL)
        return [{} for _ in range(engine.num_engines)], None
    group = placement_group([dict(bundle) for _ in range(engine.num_engines)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=config.trainer.call_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(f"rollout.engine: the cluster cannot place {engine.num_engines} "
                           f"engines of {bundle}") from None
    return [{"scheduling_strategy": PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=rank)} for rank in range(engine.num_engines)], group
