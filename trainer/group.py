"""The trainer group: one Ray actor per DP × CP rank, driven in lock step.

The group makes the step plan (aggregation coefficients from whole-step metadata,
micro-batch assignment) once, hands it to every rank inside the call, and calls the same
verb on every rank. Actors sit in a placement group: one bundle per rank, packed on one
node unless the cluster cannot hold them (``STRICT_PACK`` by default).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout.batch import RolloutBatch
from rollout.plugins import load_object
from trainer.backends.megatron import decide_attention
from trainer.config import LossConfig, ObjectiveConfig, TrainerConfig
from trainer.step_plan import StepPlan, packs, plan_step
from trainer.worker import TrainerWorker


class TrainerRankDied(RuntimeError):
    """A trainer rank's actor died (its process was killed, its node was lost, ...)."""

    def __init__(self, rank: int, verb: str, cause: Exception) -> None:
        super().__init__(f"trainer rank {rank} died during {verb}: "
                         f"{str(cause).splitlines()[0] if str(cause) else type(cause).__name__}")
        self.rank = rank


ACTOR_NAMESPACE = "tally"
"""The Ray namespace of named trainer ranks."""


class CallUndone(RuntimeError):
    """A session call failed on some rank; every rank's gradient is as before it."""


class GradientsLost(RuntimeError):
    """A session call failed and the ranks' gradients could not be restored: what the
    earlier calls of the step accumulated is lost."""


def _first_line(err: Exception) -> str:
    """An error in one line: a rank's exception (Ray's remote traceback cut), its type
    when it says nothing."""
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause if isinstance(err.cause, Exception) else None
        if cause is not None:
            return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _failed_rank(refs: list[ray.ObjectRef]) -> str | None:
    """"trainer rank r failed: <its error>" for the first rank whose call is over and
    failed; None when none is (yet)."""
    for rank, ref in enumerate(refs):
        done, _ = ray.wait([ref], timeout=0)
        if done:
            try:
                ray.get(ref)
            except Exception as err:
                return f"trainer rank {rank} failed: {_first_line(err)}"
    return None


WORKER_CLASSES = {
    "fsdp": "trainer.backends.fsdp.worker:FSDPWorker",
    "megatron": "trainer.backends.megatron.worker:MegatronWorker",
}
"""The rank actor of each ``trainer.backend``, imported only when a group is made."""
CRITIC_WORKER = "trainer.backends.fsdp.critic:FSDPCriticWorker"
"""The critic's rank actor (a group made with ``worker=CRITIC_WORKER``)."""

Verb = Callable[..., Any]
"""A ``TrainerWorker`` method, unbound (``TrainerWorker.train_step``): the group derives
the Ray method and the name its errors give from it."""


def worker_class(backend: str) -> type[TrainerWorker]:
    """The rank actor of a backend; every backend exposes the verbs of TrainerWorker."""
    if backend not in WORKER_CLASSES:
        raise ValueError(f"trainer.backend: unknown backend {backend!r}")
    return load_object(WORKER_CLASSES[backend], "trainer.backend")


MEMORY_PREFIXES = ("perf/peak_mem_gb/", "perf/peak_extra_mem_gb/")


def most(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's largest value over the ranks (times, peak memory)."""
    return {name: max(rank[name] for rank in per_rank) for name in per_rank[0]}


def _shipped(plan: StepPlan) -> StepPlan | ray.ObjectRef:
    """How a plan goes to every rank: inside each call (a few KB: Ray inlines it in the
    call, no object-store round trip), or put once when it carries dense [N, S] weights
    (a custom reducer), which Ray would otherwise store once per rank."""
    return ray.put(plan) if plan.dense_weights else plan


def _remote(worker: ray.actor.ActorHandle, verb: Verb, *args: Any, num_returns: int = 1
            ) -> Any:
    """Start ``verb`` on one rank's actor; its ref, or a list of ``num_returns`` refs."""
    method = getattr(worker, verb.__name__)
    if num_returns != 1:
        method = method.options(num_returns=num_returns)
    return method.remote(*args)


class TrainerGroup:
    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 total_steps: int, env_vars: dict[str, str] | None = None,
                 placement: PlacementGroup | None = None, name: str | None = None,
                 first_bundle: int = 0, worker: str | None = None,
                 worker_kwargs: dict[str, Any] | None = None) -> None:
        """``placement``: a placed group whose bundles first_bundle … first_bundle +
        world_size − 1 are the ranks' (the caller's, e.g. a whole job's; it stays
        theirs); None: the group makes its own. ``name``: the ranks are named actors
        ``<name>-rank<r>`` in namespace :data:`ACTOR_NAMESPACE` (a session's, so a test
        can reach one rank). ``worker``: the rank actor as ``module:Class`` (the critic's:
        :data:`CRITIC_WORKER`), default the backend's; ``worker_kwargs`` go to it."""
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
                runtime_env={"env_vars": env_vars or {}},
                **({"name": f"{name}-rank{rank}", "namespace": ACTOR_NAMESPACE}
                   if name else {}),
            ).remote(config, objective, model_path, rank, total_steps, **decided)
            for rank in range(config.world_size)
        ]
        self._call(TrainerWorker.setup, *self._rendezvous())

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
        verb = TrainerWorker.rendezvous_address
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

    def plan(self, batch: RolloutBatch, objective: ObjectiveConfig | None = None) -> StepPlan:
        """The step plan of ``batch`` for this group's layout (``objective`` overrides the
        configured one for this step only)."""
        return plan_step(batch, objective or self.objective, self.config.dp_size,
                         self.config.cp_size, self.config.max_tokens_per_micro_batch,
                         packed=packs(self.config), shared_prefix=self.config.shares_prefix)

    def train(self, batch: RolloutBatch, batch_ref: ray.ObjectRef | None = None,
              objective: ObjectiveConfig | None = None) -> dict[str, float]:
        """One optimizer step on a mini-batch of whole groups; returns its exact metrics.

        The driver holds the batch already (it plans the step); ``batch_ref`` is the same
        batch in the object store, so the ranks fetch it without another copy.
        """
        return self.start_train(batch, batch_ref, objective)()

    def start_train(self, batch: RolloutBatch, batch_ref: ray.ObjectRef | None = None,
                    objective: ObjectiveConfig | None = None
                    ) -> Callable[[], dict[str, float]]:
        """:meth:`train` started on every rank; the returned call waits for it (bounded
        and failing fast like every verb) and returns its metrics. The driver runs the
        critic's step this way while the policy's runs."""
        plan = self.plan(batch, objective)
        ref = batch_ref if batch_ref is not None else ray.put(batch)
        verb = TrainerWorker.train_step
        refs = [_remote(worker, verb, ref, _shipped(plan)) for worker in self.workers]

        def finish() -> dict[str, float]:
            self._wait(verb, refs)
            per_rank = ray.get(refs)
            memory = most([{k: v for k, v in rank.items() if k.startswith(MEMORY_PREFIXES)}
                           for rank in per_rank])
            return {**per_rank[0], **memory}  # the sums are global; memory is each rank's

        return finish

    # The training API (services/sessions): a step's gradients over several calls.

    def accumulate(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Backpropagate ``plan``'s weighted sums into the gradients (no update), as a
        transaction (trainer/session_calls.py): if any rank fails, every rank's gradient
        is put back as it was (``CallUndone``), or, when the ranks cannot do even that
        within ``call_timeout_s``, ``GradientsLost``."""
        verb = TrainerWorker.forward_backward_call
        batch_ref, plan_ref = ray.put(batch), ray.put(plan)
        refs = [_remote(worker, verb, batch_ref, plan_ref) for worker in self.workers]
        try:
            self._wait(verb, refs)
            sums = ray.get(refs[0])
        except Exception as err:
            cause = _failed_rank(refs) or _first_line(err)
            try:  # queued behind each rank's call: it runs once that call is over
                self._call(TrainerWorker.restore_call)
            except Exception as undo:
                raise GradientsLost(f"{cause}; the ranks could not restore their "
                                    f"gradients ({_first_line(undo)})") from err
            raise CallUndone(f"{cause}; every rank's gradient is restored to before "
                             "the call") from err
        try:
            self._call(TrainerWorker.commit_call)
        except Exception as err:
            raise GradientsLost(f"committing the call's gradients failed: "
                                f"{_first_line(err)}") from err
        return sums


    def evaluate(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """The sums ``accumulate`` would return, without a gradient."""
        return self._call(TrainerWorker.forward_only, ray.put(batch), ray.put(plan))[0]

    def apply_gradients(self, scale: float, adam: dict[str, Any], grad_clip: float | None
                        ) -> dict[str, float]:
        return self._call(TrainerWorker.apply_gradients, scale, adam, grad_clip)[0]

    def discard_gradients(self) -> None:
        self._call(TrainerWorker.discard_gradients)

    def use_loss(self, loss: LossConfig) -> None:
        self._call(TrainerWorker.use_loss, loss)

    def log_probs(self, batch: RolloutBatch) -> Any:
        """log π_T [N, S] of every response token under the current policy (no update)."""
        return self._call(TrainerWorker.log_probs, ray.put(batch), ray.put(self.plan(batch)))[0]

    def values(self, batch: RolloutBatch) -> Any:
        """The critic's V [N, S] of every response token (no update)."""
        return self._call(TrainerWorker.values, ray.put(batch), ray.put(self.plan(batch)))[0]

    def gradients(self, batch: RolloutBatch, objectives: list[ObjectiveConfig]
                  ) -> list[tuple[dict[str, float], dict[str, Any]]]:
        """One step's logged sums and full summed gradients under each objective, without
        an update (one call for all of them)."""
        plans = [self.plan(batch, objective) for objective in objectives]
        return self._call(TrainerWorker.gradients, ray.put(batch), ray.put(plans), objectives)[0]

    def async_export_weights(self, for_engines: bool = False) -> ray.ObjectRef:
        """Gather the full weights (collective) and wait until every rank has done its
        part, through the fail-fast, bounded wait of every verb (``TrainerRankDied``,
        ``TimeoutError``); return rank 0's state dict (numpy arrays ``for_engines``:
        ``TrainerWorker.export_engine_weights``) as a ref, never fetched into the driver.
        ``async_`` names the ref it returns: the collective is over when it returns."""
        verb = TrainerWorker.export_engine_weights if for_engines else TrainerWorker.export_weights
        receipts, weights = zip(*(_remote(worker, TrainerWorker.export_with_receipt,
                                          for_engines, num_returns=2)
                                  for worker in self.workers), strict=True)
        self._wait(verb, list(receipts))
        return weights[0]

    def async_export_weight_buckets(self, dtype: str, bucket_mb: float
                                    ) -> tuple[ray.ObjectRef, dict[str, float]]:
        """Put the weights in the object store a bucket at a time, cast to ``dtype``
        (collective, bounded like every verb); return a ref to rank 0's list of bucket
        refs (never fetched here) and the sync's time and peak memory, the most of any
        rank."""
        verb = TrainerWorker.export_weight_buckets
        receipts, buckets = zip(*(_remote(worker, verb, dtype, bucket_mb, num_returns=2)
                                  for worker in self.workers), strict=True)
        self._wait(verb, list(receipts))
        return buckets[0], most(ray.get(list(receipts)))

    # The GPU weight transports (services/driver/weight_sync.py).

    def _on_rank0(self, verb: Verb, *args: Any) -> Any:
        ref = _remote(self.workers[0], verb, *args)
        self._wait(verb, [ref])
        return ray.get(ref)

    def weight_group_address(self) -> tuple[str, int]:
        return self._on_rank0(TrainerWorker.weight_group_address)

    def join_weight_group(self, address: str, port: int, world_size: int,
                          group_name: str) -> None:
        self._on_rank0(TrainerWorker.join_weight_group, address, port, world_size,
                       group_name)

    def weight_bucket_specs(self, dtype: str, bucket_mb: float) -> list:
        return self._call(TrainerWorker.weight_bucket_specs, dtype, bucket_mb)[0]

    def broadcast_weight_buckets(self, dtype: str, bucket_mb: float) -> dict[str, float]:
        return most(self._call(TrainerWorker.broadcast_weight_buckets, dtype, bucket_mb))

    def share_weight_bucket(self, index: int, dtype: str, bucket_mb: float, tp_size: int
                            ) -> tuple[list[str], dict[str, float]]:
        answers = self._call(TrainerWorker.share_weight_bucket, index, dtype, bucket_mb,
                             tp_size)
        return answers[0][0], most([metrics for _, metrics in answers])

    def release_shared_bucket(self) -> None:
        self._on_rank0(TrainerWorker.release_shared_bucket)

    def load_weights(self, state_dict: dict | ray.ObjectRef) -> None:
        """Replace the policy weights on every rank (rank 0's copy is broadcast)."""
        ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(state_dict)
        verb = TrainerWorker.load_weights
        self._wait(verb, [_remote(worker, verb, ref if rank == 0 else None)
                          for rank, worker in enumerate(self.workers)])

    def save_checkpoint(self, path: str) -> dict[str, float]:
        """Every rank writes its shards at ``path``; the time and peak memory, the most
        of any rank."""
        return most(self._call(TrainerWorker.checkpoint, path))

    def load_checkpoint(self, path: str) -> None:
        self._call(TrainerWorker.load_checkpoint, path)

    def worker_nodes(self) -> list[str]:
        """The Ray node id of each rank, in rank order."""
        return self._call(TrainerWorker.node_id)

    def shutdown(self) -> None:
        """Kill every rank: a rank stuck in a collective with a dead peer would never
        answer a polite call; its process group dies with its process."""
        for worker in self.workers:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(worker)
        if self.owns_placement:
            remove_placement_group(self.placement_group)
