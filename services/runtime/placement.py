"""Where a job's actors go: one placement group holds the whole job (gang placement).

    bundles  [rank 0 … rank W-1 | engine 0 … engine E-1 | teacher 0 … teacher T-1]
              trainer ranks        rollout engines         distillation teachers
              (engines colocated: no engine bundles)       rollout manager: bundle 0, 0 CPU

Ray reserves a placement group's bundles all at once or not at all, so a job that does
not fit waits holding nothing, and two jobs can never each hold half of what the other
needs. While it waits, the job writes a ``waiting`` event ("waiting for resources: needs
1.5 CPU, cluster has 0.5 free"). With ``colocate: true`` an engine runs inside a rank's
bundle (on its node and device). Trainer ranks must share one node unless
``trainer.allow_cross_node``; with engine bundles in the group that is checked once the
group is placed (Ray has one strategy per group).

A Ray head that Tally starts itself (``tally train`` without ``--address`` /
``RAY_ADDRESS``) knows everything it will ever have, so a job it cannot place is refused
before anything starts, naming the field (:func:`check_local_head`); only a cluster, where
nodes may still join, is waited on.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.engines import engine_actor_options
from services.config.job import ConfigError, ConfigProblem, JobConfig

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
    least one thread), except on the colocated fast path, where a rank generates and
    trains in turn whatever the pipeline. A model narrower than SMALL_HIDDEN_SIZE runs on
    one thread.
    """
    cores = cores or len(os.sched_getaffinity(0))
    engine_share = getattr(config.rollout.engine, "num_cpus", 1.0)
    if config.rollout.async_steps and config.weight_transport() != "in_process":
        engine, rank = engine_share, config.trainer.num_cpus_per_rank
    else:
        engine = cores / config.rollout.engine.num_engines
        rank = cores / config.trainer.world_size
    if narrow_model(model_path):
        engine = rank = 1
    engine_threads = getattr(config.rollout.engine, "num_threads", None)
    return (engine_threads or max(1, int(engine)),
            config.trainer.num_threads or max(1, int(rank)))


def narrow_model(model_path: str) -> bool:
    """Whether the model is narrower than SMALL_HIDDEN_SIZE (or names no width): its
    ops are too small to split over threads, one runs faster."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("hidden_size") or config.get("n_embd") or 0) < SMALL_HIDDEN_SIZE


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


def teacher_bundle(config: JobConfig) -> dict[str, float]:
    """One distillation teacher's bundle; empty without a teacher or when it needs
    nothing."""
    teacher = config.rollout.distillation
    if teacher is None:
        return {}
    bundle = {"CPU": teacher.num_cpus, "GPU": teacher.num_gpus}
    return {name: amount for name, amount in bundle.items() if amount}


def num_teachers(config: JobConfig) -> int:
    teacher = config.rollout.distillation
    return teacher.num_actors if teacher is not None else 0


def reward_bundles(config: JobConfig) -> list[dict[str, float]]:
    """One bundle per reward actor (reward models, judges without a url), in the order
    they start (rollout/reward_parts.start_reward_actors); empty for an actor that needs
    nothing (it gets no bundle)."""
    from rollout.reward_parts import reward_actor_bundles  # each part says its own

    return reward_actor_bundles(config.rollout.reward_parts)


def critic_bundles(config: JobConfig) -> list[dict[str, float]]:
    """The critic's rank bundles (its trainer config's), none without a critic."""
    if not config.critic.enabled:
        return []
    critic = config.critic_trainer_config()
    return [critic.rank_bundle for _ in range(critic.world_size)]


def job_bundles(config: JobConfig) -> list[dict[str, float]]:
    """Every bundle of the job: trainer ranks, engines, teachers, critic ranks."""
    engines, teachers = engine_bundle(config), teacher_bundle(config)
    return ([dict(trainer_bundle(config)) for _ in range(config.trainer.world_size)]
            + ([dict(engines) for _ in range(config.rollout.engine.num_engines)]
               if engines else [])
            + ([dict(teachers) for _ in range(num_teachers(config))] if teachers else [])
            + [bundle for bundle in reward_bundles(config) if bundle]
            + critic_bundles(config))


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
    num_teacher_bundles: int = 0
    reward_has_bundle: list[bool] = field(default_factory=list)
    """Per reward actor (rollout/reward_parts.start_reward_actors' order): whether it has
    a bundle (after the teachers')."""
    engine_options: list[dict[str, Any]] = field(init=False)
    teacher_options: list[dict[str, Any]] = field(init=False)
    """Per teacher actor: its bundle after the engines'; empty options when teachers have
    no bundles (they need no resource)."""

    reward_options: list[dict[str, Any]] = field(init=False)
    """Per reward actor: its bundle's options, or none when it needs no resource."""
    critic_first_bundle: int = field(init=False)
    """The critic's rank 0 bundle (its ranks' follow), after the reward actors'."""

    def __post_init__(self) -> None:
        self.engine_options = [self._engine(rank) for rank in range(self.num_engines)]
        first = self.world_size + (self.num_engines if self.has_engine_bundles else 0)
        self.teacher_options = [{"scheduling_strategy": self.strategy(first + rank)}
                                for rank in range(self.num_teacher_bundles)]
        first += self.num_teacher_bundles
        self.reward_options = []
        for has_bundle in self.reward_has_bundle:
            self.reward_options.append({"scheduling_strategy": self.strategy(first)}
                                       if has_bundle else {})
            first += has_bundle
        self.critic_first_bundle = first

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


AUTOSCALING_ENV = "TALLY_CLUSTER_AUTOSCALES"
"""Set (to 1) where the Ray cluster grows on demand (the KubeRay manifests set it): its
alive nodes are then not all it will have, so a job larger than them waits (up to
``placement_timeout_s``) instead of being refused at once."""


def fields_asking(config: JobConfig, resource: str) -> list[str]:
    """The config fields whose bundles ask for ``resource`` (what a user lowers)."""
    asks = {"trainer.num_cpus_per_rank / trainer.dp_size": trainer_bundle(config),
            "rollout.engine.num_cpus / rollout.engine.num_engines": engine_bundle(config),
            "rollout.teacher.num_cpus": teacher_bundle(config),
            "critic (its trainer's num_cpus_per_rank)": (critic_bundles(config) or [{}])[0]}
    from rollout.reward_parts import reward_actor_bundles

    listed = isinstance(config.rollout.reward, list)  # rollout.reward[k], else one block
    for k, part in enumerate(config.rollout.reward_parts):  # by part, not by actor
        bundles = reward_actor_bundles([part])
        asks[f"rollout.reward{f'[{k}]' if listed else ''}.num_cpus"] = \
            bundles[0] if bundles else {}
    names = [name for name, bundle in asks.items() if bundle.get(resource)]
    if resource == "GPU":
        names = [name.replace("num_cpus_per_rank", "num_gpus_per_rank")
                 .replace("num_cpus", "num_gpus") for name in names]
    elif resource != "CPU":
        names = [f"{name.split(' ')[0].rsplit('.', 1)[0]}.resources" for name in names]
    return names


def never_fits(config: JobConfig, nodes: list[dict[str, float]]) -> str | None:
    """Why the job can never be placed on a cluster of these alive nodes (their total
    resources, and one node for the trainer ranks unless ``trainer.allow_cross_node``),
    in one line naming what it needs, what the cluster has and the fields to change; None
    when it can fit once the cluster is free."""
    needs, total = job_needs(config), {}
    for node in nodes:
        for name, amount in node.items():
            total[name] = total.get(name, 0.0) + amount
    short = [name for name in sorted(needs) if needs[name] > total.get(name, 0.0) + 1e-9]
    if short:
        need = ", ".join(f"{needs[n]:g} {n}" for n in short)
        have = ", ".join(f"{total.get(n, 0.0):g} {n}" for n in short)
        fields = ", ".join(f for n in short for f in fields_asking(config, n))
        return (f"the job can never fit this Ray cluster: it needs {need}, the cluster has "
                f"{have} in all; lower {fields}, or give the cluster more (e.g. ray start "
                "--head --num-cpus=N)")
    if not config.trainer.allow_cross_node:
        ranks = _times(trainer_bundle(config), config.trainer.world_size)
        if not any(all(amount <= node.get(name, 0.0) + 1e-9 for name, amount in ranks.items())
                   for node in nodes):
            need = ", ".join(f"{amount:g} {name}" for name, amount in sorted(ranks.items()))
            return (f"the job can never fit this Ray cluster: its {config.trainer.world_size} "
                    f"trainer ranks need {need} on one node and no node has that; lower "
                    "trainer.dp_size or trainer.num_cpus_per_rank, or set "
                    "trainer.allow_cross_node: true")
    return None


def _times(bundle: dict[str, float], count: int) -> dict[str, float]:
    return {name: amount * count for name, amount in bundle.items()}


class PlacementFailed(RuntimeError):
    """The job's gang cannot be placed (said in one line): never a fault to retry."""


class NeverFits(PlacementFailed):
    """The job can never be placed on this cluster."""


def refuse_if_never_fits(config: JobConfig) -> None:
    """NeverFits when the job is larger than the Ray cluster this process joined (its alive
    nodes), unless the cluster autoscales (:data:`AUTOSCALING_ENV`)."""
    import ray

    if os.environ.get(AUTOSCALING_ENV):
        return
    nodes = [{name: float(amount) for name, amount in node["Resources"].items()}
             for node in ray.nodes() if node.get("Alive")]
    if why := never_fits(config, nodes):
        raise NeverFits(why)


def reserve_job(config: JobConfig, on_wait: Callable[[str], None] = print,
                timeout_s: float | None = None) -> JobPlacement:
    """Reserve every bundle of the job in one placement group; wait (holding nothing) up
    to ``timeout_s`` (default ``placement_timeout_s``), reporting through ``on_wait``. A
    job larger than the whole cluster is refused at once (:func:`refuse_if_never_fits`)."""
    import ray
    from ray.util.placement_group import (
        placement_group,
        placement_group_table,
        remove_placement_group,
    )

    refuse_if_never_fits(config)
    bundles = job_bundles(config)
    has_engines = bool(engine_bundle(config))
    teachers_placed = bool(teacher_bundle(config)) or any(reward_bundles(config))
    one_node = not config.trainer.allow_cross_node
    strategy = ("STRICT_PACK" if one_node and not (has_engines or teachers_placed)
                else "PACK")
    timeout_s = config.placement_timeout_s if timeout_s is None else timeout_s
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
            raise PlacementFailed(f"the cluster cannot place the job within {timeout_s:.0f} s "
                               f"(placement_timeout_s; "
                               f"{message.removeprefix('waiting for resources: ')})")
    if one_node and (has_engines or teachers_placed):
        nodes = placement_group_table(group)["bundles_to_node_id"]
        if len({nodes[i] for i in range(config.trainer.world_size)}) > 1:
            remove_placement_group(group)
            raise RuntimeError(f"trainer: the cluster cannot place {config.trainer.world_size}"
                               f" ranks of {trainer_bundle(config)} on one node")
        critics = range(len(bundles) - len(critic_bundles(config)), len(bundles))
        if len({nodes[i] for i in critics}) > 1:
            remove_placement_group(group)
            raise RuntimeError(f"critic: the cluster cannot place its {len(critics)} ranks "
                               "on one node")
    return JobPlacement(group, config.trainer.world_size, config.rollout.engine.num_engines,
                        config.colocate, has_engines,
                        num_teachers(config) if teacher_bundle(config) else 0,
                        [bool(bundle) for bundle in reward_bundles(config)])


# ---- a Ray head started here: what it has, and a job it could never place ------------

HEAD_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""What a Ray head started by ``ray.init`` has; any other resource a job asks for (a node
label) it never will."""


def starts_local_head() -> bool:
    """Whether ``ensure_ray`` will start a Ray head in this process: no ``RAY_ADDRESS``
    (``--address``) and Ray not yet initialized here."""
    ray = sys.modules.get("ray")
    return not os.environ.get("RAY_ADDRESS") and not (ray is not None and ray.is_initialized())


def local_head_cpus(config: JobConfig) -> int:
    """CPUs of the head Tally starts for this job: every core, and at least what the
    trainer ranks (and the critic's) need plus two (an oversubscribed small machine
    runs; an undersized head would wait forever)."""
    needed = (config.trainer.world_size * config.trainer.num_cpus_per_rank
              + sum(bundle.get("CPU", 0.0) for bundle in critic_bundles(config)) + 2)
    return max(os.cpu_count() or 1, int(needed + 0.999))


def local_gpu_count() -> int:
    """GPUs a Ray head started here gets: CUDA's device count (``CUDA_VISIBLE_DEVICES``
    applied, as Ray applies it). A machine with no NVIDIA (or ROCm, or WSL) device node
    has none, said without importing torch (1-2 s); only a machine that may have a GPU
    asks torch, lazily: the controller never calls this."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    nodes = ("nvidia[0-9]*", "kfd", "dxg")
    if not any(next(Path("/dev").glob(pattern), None) for pattern in nodes):
        return 0
    import torch

    return torch.cuda.device_count()


def check_local_head(config: JobConfig, num_cpus: int | None = None,
                     num_gpus: int | None = None) -> None:
    """Refuse (ConfigError naming the field) a job the Ray head Tally starts here could
    never place: it would wait for resources forever. ``num_cpus`` / ``num_gpus``: the
    head's (default :func:`local_head_cpus`, and :func:`local_gpu_count` when the job
    asks for a GPU at all)."""
    needs, engine, trainer = job_needs(config), config.rollout.engine, config.trainer
    cuda_engine = getattr(engine, "device", "cpu").startswith("cuda")
    cpus = local_head_cpus(config) if num_cpus is None else num_cpus
    gpus = num_gpus if num_gpus is not None else (
        local_gpu_count() if needs.get("GPU") or cuda_engine else 0)
    has = f"Ray head started by Tally: {_count(cpus, 'CPU')}, {_count(gpus, 'GPU')}"
    machine = f"this machine has {'no GPU' if not gpus else 'only ' + _count(gpus, 'GPU')}"
    join = "or join a cluster with --address"
    problems = [ConfigProblem(f"{section}.resources", f"asks for {name!r}, which this "
                              f"machine does not have ({has}); remove it {join}")
                for section, bundle in (("trainer", trainer_bundle(config)),
                                        ("rollout.engine", engine_bundle(config)))
                for name in bundle if name not in HEAD_RESOURCES]
    rank_gpus = trainer.world_size * trainer.num_gpus_per_rank
    all_gpus = needs.get("GPU", 0.0)
    if rank_gpus > gpus + 1e-9:
        ranks = (f" ({trainer.world_size} ranks: {_count(rank_gpus, 'GPU')})"
                 if trainer.world_size > 1 else "")
        fix = "set it to 0" if not gpus else "lower it (or trainer.dp_size),"
        problems.append(ConfigProblem("trainer.num_gpus_per_rank", (
            f"{trainer.num_gpus_per_rank:g} GPU per rank asked for{ranks}, but {machine} "
            f"({has}); {fix} {join}")))
    elif all_gpus > gpus + 1e-9:  # the engines' own bundles tip it over
        field = ("rollout.engine.tp_size" if getattr(engine, "num_gpus", 0) is None
                 else "rollout.engine.num_gpus")
        per_engine = (all_gpus - rank_gpus) / engine.num_engines
        ranks = f" and {rank_gpus:g} for the trainer" if rank_gpus else ""
        fix = ("give running servers in rollout.engine.urls" if engine.type == "sglang"
               else "set rollout.engine.num_gpus to 0")
        problems.append(ConfigProblem(field, (
            f"{per_engine:g} GPU per engine asked for ({_count(engine.num_engines, 'engine')}"
            f"{ranks}: {_count(all_gpus, 'GPU')} in all), but {machine} ({has}); {fix} "
            f"{join}")))
    if cuda_engine and not gpus:
        problems.append(ConfigProblem("rollout.engine.device", (
            f"{engine.device} asked for, but this machine has no GPU ({has}); set it to cpu "
            f"{join}")))
    if needs.get("CPU", 0.0) > cpus + 1e-9:  # the ranks always fit: local_head_cpus
        problems.append(ConfigProblem("rollout.engine.num_cpus", (
            f"{getattr(engine, 'num_cpus', 0):g} CPUs per engine asked for "
            f"({_count(needs['CPU'], 'CPU')} in all with the trainer ranks), but this "
            f"machine has {cpus} ({has}); lower it {join}")))
    if problems:
        raise ConfigError("", problems)


def _count(amount: float, what: str) -> str:
    return f"{amount:g} {what}{'s' * (amount != 1)}"
