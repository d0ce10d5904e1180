"""The mechanics of a group of rank actors, whatever their role: one Ray actor per DP ×
CP rank in a placement group, rendezvous, the same verb on every rank in lock step
(bounded, failing fast when a rank dies), checkpoints, weights in and out, shutdown.

    RankGroup (here)  ─►  TrainerGroup  (trainer/group.py: the policy's verbs)
                      ─►  CriticGroup   (trainer/group.py: the critic's values)
                      ─►  RewardModelGroup (trainer/reward_model_group.py: pairs)

A role's group adds only its own verbs; its rank actor has only those (trainer/worker.py).
Actors sit in a placement group: one bundle per rank, packed on one node unless the
cluster cannot hold them (``STRICT_PACK`` by default).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout.plugins import load_object
from trainer.backends.megatron import decide_attention
from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.worker import TrainerRank


class TrainerRankDied(RuntimeError):
    """A trainer rank's actor died (its process was killed, its node was lost, ...)."""

    def __init__(self, rank: int, verb: str, cause: Exception) -> None:
        super().__init__(f"trainer rank {rank} died during {verb}: "
                         f"{str(cause).splitlines()[0] if str(cause) else type(cause).__name__}")
        self.rank = rank


ACTOR_NAMESPACE = "tally"
"""The Ray namespace of named trainer ranks."""

WORKER_CLASSES = {
    "fsdp": "trainer.backends.fsdp.worker:FSDPWorker",
    "megatron": "trainer.backends.megatron.worker:MegatronWorker",
}
"""The policy's rank actor of each ``trainer.backend``, imported only when a group is made."""

Verb = Callable[..., Any]
"""A rank's method, unbound (``TrainerRank.checkpoint``): the group derives the Ray
method and the name its errors give from it."""


def worker_class(backend: str) -> type[TrainerRank]:
    """The policy's rank actor of a backend."""
    if backend not in WORKER_CLASSES:
        raise ValueError(f"trainer.backend: unknown backend {backend!r}")
    return load_object(WORKER_CLASSES[backend], "trainer.backend")


MEMORY_PREFIXES = ("perf/peak_mem_gb/", "perf/peak_extra_mem_gb/")


def most(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's largest value over the ranks (times, peak memory)."""
    return {name: max(rank[name] for rank in per_rank) for name in per_rank[0]}


def _remote(worker: ray.actor.ActorHandle, verb: Verb, *args: Any, num_returns: int = 1
            ) -> Any:
    """Start ``verb`` on one rank's actor; its ref, or a list of ``num_returns`` refs."""
    method = getattr(worker, verb.__name__)
    if num_returns != 1:
        method = method.options(num_returns=num_returns)
    return method.remote(*args)


class RankGroup:
    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 total_steps: int, env_vars: dict[str, str] | None = None,
                 placement: PlacementGroup | None = None, name: str | None = None,
                 first_bundle: int = 0, worker: str | None = None,
                 worker_kwargs: dict[str, Any] | None = None) -> None:
        """``placement``: a placed group whose bundles first_bundle … first_bundle +
        world_size − 1 are the ranks' (the caller's, e.g. a whole job's; it stays
        theirs); None: the group makes its own. ``name``: the ranks are named actors
        ``<name>-rank<r>`` in namespace :data:`ACTOR_NAMESPACE` (a session's, so a test
        can reach one rank). ``worker``: the rank actor as ``module:Class`` (a role's
        group names its own), default the backend's policy rank; ``worker_kwargs`` go to
        it."""
        self.config, self.objective = config, objective
        self.owns_placement = placement is None
        self.placement_group: PlacementGroup = placement or self._place(config)
        actor_cls = ray.remote(load_object(worker, "worker") if worker
                               else worker_class(config.backend))
        decided: dict[str, Any] = dict(worker_kwargs or {})
        # Megatron's attention is decided once, here, by the rule the step plan packs by;
        # the ranks take it rather than detect TransformerEngine again.
        if config.backend == "megatron":
            decided["attention"] = decide_attention(config)
        self.workers = [
            actor_cls.options(
                num_cpus=config.num_cpus_per_rank,
                num_gpus=config.num_gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=first_bundle + rank),
                **({"runtime_env": {"env_vars": env_vars}} if env_vars else {}),
                **({"name": f"{name}-rank{rank}", "namespace": ACTOR_NAMESPACE}
                   if name else {}),
            ).remote(config, objective, model_path, rank, total_steps, **decided)
            for rank in range(config.world_size)
        ]
        self._worker_kwargs = decided
        self._call(TrainerRank.setup, *self._rendezvous())

    def rebuild(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                total_steps: int) -> None:
        """Verify-only: the same rank processes as a new group of ``config``'s layout
        (another DP × CP split, packing, prefix of the same world size): each rank leaves
        its process group and forgets everything (``TrainerRank.rebuild``), then a new
        rendezvous and ``setup`` build model, optimizer and RNG as a new group's would.
        ValueError when ``config`` needs other actors (world size, resources, backend)."""
        if not self.rebuilds_in_place(self.config):
            raise ValueError(f"trainer: a {self.config.backend} group is not rebuilt in place")
        fixed = ("world_size", "rank_bundle", "backend")
        changed = [name for name in fixed
                   if getattr(config, name) != getattr(self.config, name)]
        if changed:
            raise ValueError(f"trainer: a group cannot be rebuilt with another {changed}")
        self._call(TrainerRank.rebuild, config, objective, model_path, total_steps,
                   self._worker_kwargs)
        self.config, self.objective = config, objective
        self._call(TrainerRank.setup, *self._rendezvous())

    @staticmethod
    def rebuilds_in_place(config: TrainerConfig) -> bool:
        """Whether :meth:`rebuild` serves this backend: FSDP's ranks keep all their state
        on the rank and in torch.distributed's groups; Megatron's model-parallel state
        lives in module globals (megatron.core.parallel_state) that ``TrainerRank.rebuild``
        does not tear down, so its groups are started anew."""
        return config.backend == "fsdp"

    @staticmethod
    def _place(config: TrainerConfig) -> PlacementGroup:
        bundle = config.rank_bundle
        group = placement_group([config.rank_bundle for _ in range(config.world_size)],
                                strategy="PACK" if config.allow_cross_node else "STRICT_PACK")
        try:
            ray.get(group.ready(), timeout=config.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(
                f"trainer: the cluster cannot place {config.world_size} ranks of {bundle}"
                f"{'' if config.allow_cross_node else ' on one node'} within "
                f"{config.call_timeout_s:.0f} s") from None
        return group

    def _rendezvous(self) -> tuple[str, int]:
        """Where rank 0's store listens: rank 0 binds the port itself, so no other process
        can take it between choosing and using it."""
        verb = TrainerRank.rendezvous_address
        ref = _remote(self.workers[0], verb)
        self._wait(verb, [ref])
        return ray.get(ref)

    def _wait(self, verb: Verb, refs: list[ray.ObjectRef]) -> None:
        """Wait for ``refs`` (``refs[rank]``: that rank's call of ``verb``), failing fast:
        the first rank that dies raises at once (its peers may be stuck in a collective
        waiting for it), and a verb past ``call_timeout_s`` raises too."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=self.config.call_timeout_s)
            if not ready:
                stuck = sorted(rank_of[r] for r in pending)
                raise TimeoutError(f"trainer: ranks {stuck} did not finish {verb.__name__} "
                                   f"within {self.config.call_timeout_s:.0f} s")
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as err:
                raise TrainerRankDied(rank_of[ready[0]], verb.__name__, err) from err

    def _start(self, verb: Verb, *args: Any) -> list[ray.ObjectRef]:
        """Start ``verb`` with ``args`` on every rank at once; their refs, in rank order,
        for :meth:`_wait` (a role's group that must act on a failure before waiting)."""
        return [_remote(worker, verb, *args) for worker in self.workers]

    def _call(self, verb: Verb, *args: Any) -> list[Any]:
        """Run ``verb`` with ``args`` on every rank at once; every rank's answer."""
        return self.call_each(verb, [args] * len(self.workers))

    def call_each(self, verb: Verb, args: list[tuple[Any, ...]]) -> list[Any]:
        """Run ``verb`` on every rank at once, rank r with ``args[r]``, bounded and failing
        fast like every verb; every rank's answer. For a group composed elsewhere (a
        colocated engine, services/driver/colocated.py) that adds verbs of its own."""
        refs = [_remote(worker, verb, *rank_args)
                for worker, rank_args in zip(self.workers, args, strict=True)]
        self._wait(verb, refs)
        return ray.get(refs)

    def async_export_weights(self) -> ray.ObjectRef:
        """Gather the full weights (collective) and wait until every rank has done its
        part, through the fail-fast, bounded wait of every verb (``TrainerRankDied``,
        ``TimeoutError``); return rank 0's HF state dict as a ref, never fetched into the
        driver. ``async_`` names the ref it returns: the collective is over when it
        returns. The engines get weights by a transport (services/driver/transports/)."""
        receipts, weights = zip(*(_remote(worker, TrainerRank.export_with_receipt,
                                          num_returns=2)
                                  for worker in self.workers), strict=True)
        self._wait(TrainerRank.export_weights, list(receipts))
        return weights[0]

    def _on_rank0(self, verb: Verb, *args: Any) -> Any:
        ref = _remote(self.workers[0], verb, *args)
        self._wait(verb, [ref])
        return ray.get(ref)

    def load_weights(self, state_dict: dict | ray.ObjectRef) -> None:
        """Replace the weights on every rank (rank 0's copy is broadcast)."""
        ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(state_dict)
        verb = TrainerRank.load_weights
        self._wait(verb, [_remote(worker, verb, ref if rank == 0 else None)
                          for rank, worker in enumerate(self.workers)])

    def save_checkpoint(self, path: str) -> dict[str, float]:
        """Every rank writes its shards at ``path``; the time and peak memory, the most
        of any rank."""
        return most(self._call(TrainerRank.checkpoint, path))

    def load_checkpoint(self, path: str) -> None:
        self._call(TrainerRank.load_checkpoint, path)

    def worker_nodes(self) -> list[str]:
        """The Ray node id of each rank, in rank order."""
        return self._call(TrainerRank.node_id)

    def shutdown(self) -> None:
        """Kill every rank: a rank stuck in a collective with a dead peer would never
        answer a polite call; its process group dies with its process."""
        for worker in self.workers:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(worker)
        if self.owns_placement:
            remove_placement_group(self.placement_group)
