"""The reward model's trainer group: ``RankGroup``'s rank actors (placement, rendezvous,
fail-fast bounded calls, checkpoints, shutdown) running ``FSDPRewardModelWorker``, with
the score role's verbs only (those of ``tally train-rm``). The group plans each step
(trainer/pair_batch.py) and hands the plan to every rank inside the call, as the policy's
group does."""

from __future__ import annotations

import ray
import torch

from trainer.backends.fsdp.reward_model import FSDPRewardModelWorker
from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.pair_batch import PairBatch, PairPlan, plan_pairs
from trainer.rank_group import MEMORY_PREFIXES, RankGroup, most

REWARD_MODEL_WORKER = "trainer.backends.fsdp.reward_model:FSDPRewardModelWorker"
"""The reward model's rank actor."""


class RewardModelGroup(RankGroup):
    """One actor per DP rank training a one-label sequence classifier on pairs."""

    def __init__(self, config: TrainerConfig, model_path: str, total_steps: int,
                 pad_token_id: int, env_vars: dict[str, str] | None = None,
                 center_rewards_coefficient: float = 0.0) -> None:
        """``center_rewards_coefficient``: c of the centring term (trainer/bradley_terry.py);
        each pair's margin comes with the batch."""
        super().__init__(config, ObjectiveConfig(), model_path, total_steps,
                         env_vars=env_vars, worker=REWARD_MODEL_WORKER,
                         worker_kwargs={"pad_token_id": pad_token_id,
                                        "center_rewards_coefficient":
                                            center_rewards_coefficient})

    def plan_pairs(self, batch: PairBatch) -> PairPlan:
        return plan_pairs(batch.lengths_N, self.config.dp_size,
                          self.config.max_tokens_per_micro_batch, self.config.packing)

    def train_pairs(self, batch: PairBatch) -> dict[str, float]:
        """One optimizer step on the batch's pairs: its exact metrics (rank 0's: they are
        global) with each rank's peak memory, the most of any."""
        per_rank = self._call(FSDPRewardModelWorker.pair_train_step, ray.put(batch),
                              self.plan_pairs(batch))
        memory = most([{k: v for k, v in rank.items() if k.startswith(MEMORY_PREFIXES)}
                       for rank in per_rank])
        return {**per_rank[0], **memory}

    def scores(self, batch: PairBatch) -> torch.Tensor:
        """Every sequence's score [2P] (float64) under the current weights, no update."""
        return self._call(FSDPRewardModelWorker.pair_scores, ray.put(batch),
                          self.plan_pairs(batch))[0]

    def save_reward_model(self, path: str) -> None:
        """Rank 0 writes the Hugging Face weights and config.json into ``path``."""
        self._call(FSDPRewardModelWorker.save_reward_model, path)
