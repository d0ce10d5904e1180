"""The groups of the roles that step on rollouts: the policy's (``TrainerGroup``) and the
critic's (``CriticGroup``), over the rank mechanics of ``RankGroup`` (trainer/rank_group.py).

The group makes the step plan (aggregation coefficients from whole-step metadata,
micro-batch assignment) once, hands it to every rank inside the call, and calls the same
verb on every rank. Each group offers its role's verbs only: log-probs (its own and the
reference's) and the weights out (one verb, ``send_weights``, whatever the transport) for
the policy, values for the critic (the reward model's group:
trainer/reward_model_group.py; a session's transactions: services/sessions/calls.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from rollout.batch import RolloutBatch
from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.policy_rank import PolicyRank
from trainer.rank_group import (
    ACTOR_NAMESPACE,
    MEMORY_PREFIXES,
    WORKER_CLASSES,
    RankGroup,
    TrainerRankDied,
    _remote,
    most,
    worker_class,
)
from trainer.step_plan import StepPlan, packs, plan_step
from trainer.transports.base import SenderStep
from trainer.worker import BatchRank

__all__ = ["ACTOR_NAMESPACE", "CRITIC_WORKER", "MEMORY_PREFIXES", "WORKER_CLASSES",
           "CriticGroup", "RolloutGroup", "TrainerGroup", "TrainerRankDied", "most",
           "worker_class"]

CRITIC_WORKER = "trainer.backends.fsdp.critic:FSDPCriticWorker"
"""The critic's rank actor (what :class:`CriticGroup` runs)."""


def _shipped(plan: StepPlan) -> StepPlan | ray.ObjectRef:
    """How a plan goes to every rank: inside each call (a few KB: Ray inlines it in the
    call, no object-store round trip), or put once when it carries dense [N, S] weights
    (a custom reducer), which Ray would otherwise store once per rank."""
    return ray.put(plan) if plan.dense_weights else plan


class RolloutGroup(RankGroup):
    """A group whose ranks step on rollouts (``BatchRank``): plan, train, gradients."""

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
        verb = BatchRank.train_step
        refs = [_remote(worker, verb, ref, _shipped(plan)) for worker in self.workers]

        def finish() -> dict[str, float]:
            self._wait(verb, refs)
            per_rank = ray.get(refs)
            memory = most([{k: v for k, v in rank.items() if k.startswith(MEMORY_PREFIXES)}
                           for rank in per_rank])
            return {**per_rank[0], **memory}  # the sums are global; memory is each rank's

        return finish

    def gradients(self, batch: RolloutBatch, objectives: list[ObjectiveConfig]
                  ) -> list[tuple[dict[str, float], dict[str, Any]]]:
        """One step's logged sums and full summed gradients under each objective, without
        an update (one call for all of them)."""
        plans = [self.plan(batch, objective) for objective in objectives]
        return self._call(BatchRank.gradients, ray.put(batch), ray.put(plans), objectives)[0]


class TrainerGroup(RolloutGroup):
    """The policy's group: its ranks' log-probs, and the weights out to the engines."""

    def log_probs(self, batch: RolloutBatch) -> Any:
        """log π_T [N, S] of every response token under the current policy (no update)."""
        return self._call(PolicyRank.log_probs, ray.put(batch), ray.put(self.plan(batch)))[0]

    def token_stats(self, batch: RolloutBatch) -> Any:
        """(log π_T, H(π_T)) [N, S] of every response token under the current policy, no
        update: the per-token view of logged samples (services/driver/sample_tokens.py)."""
        return self._call(PolicyRank.token_stats, ray.put(batch), ray.put(self.plan(batch)))[0]

    def reference_log_probs(self, batch: RolloutBatch) -> Any:
        """log π_ref,T [N, S] of every response token under the frozen reference (the KL
        in the reward's k1; needs ``kl_coef > 0``)."""
        return self._call(PolicyRank.reference_log_probs, ray.put(batch),
                          ray.put(self.plan(batch)))[0]

    def send_weights(self, step: SenderStep, sender: Any, *args: Any,
                     rank0: bool = False) -> list[Any]:
        """One step of a weight transport's rank side (trainer/transports/) on every rank
        at once (rank 0 alone when ``rank0``), bounded and failing fast like every verb;
        every rank's answer. The driver's transports (services/driver/transports/) call
        only this."""
        if rank0:
            return [self._on_rank0(PolicyRank.send_weights, step, sender, *args)]
        return self._call(PolicyRank.send_weights, step, sender, *args)


class CriticGroup(RolloutGroup):
    """The critic's group (PPO): its ranks' values V [N, S] and the value loss's steps."""

    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 total_steps: int, value_clip: float | None, **kwargs: Any) -> None:
        super().__init__(config, objective, model_path, total_steps, worker=CRITIC_WORKER,
                         worker_kwargs={"value_clip": value_clip}, **kwargs)

    def values(self, batch: RolloutBatch) -> Any:
        """The critic's V [N, S] of every response token (no update)."""
        from trainer.backends.fsdp.critic import FSDPCriticWorker  # the backend on use

        return self._call(FSDPCriticWorker.values, ray.put(batch), ray.put(self.plan(batch)))[0]

