"""The verifier's critic part of a PPO job: each layout's batch is production's GAE
(``rollout.advantages.with_gae``, what the driver runs) over the reference critic's
values, whitened by production's ``whiten_over_ranks`` with the statistics of every
DP × CP rank of that layout (``rank_token_moments``) in place of the driver's whole
rollout; the planted ``local_whitening`` whitens each DP rank's samples with its own
instead."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from trainer.planted import NOTHING_PLANTED, Planted, PlantedError

if TYPE_CHECKING:
    import torch

    from rollout.batch import RolloutBatch
    from services.config.job import JobConfig
    from trainer.verify import CriticCheck, Layout


def whitened_for_layout(advantages: torch.Tensor, mask: torch.Tensor,
                        moments: torch.Tensor, micro_batches: list[list[list[int]]],
                        eps: float, planted: Planted = NOTHING_PLANTED) -> torch.Tensor:
    """GAE's advantages [N, S] whitened as a layout's ranks do: production's
    ``whiten_over_ranks`` with ``moments`` ([dp, cp, 3], every rank's (n, Σ A, Σ A²));
    with ``local_whitening`` planted, each DP rank's samples (its ``micro_batches``) by
    its own (the classic silent error)."""
    import torch

    from rollout.advantages.whitening import whiten_over_ranks

    if PlantedError.LOCAL_WHITENING not in planted:
        return whiten_over_ranks(advantages, mask, moments, eps)
    whitened = torch.zeros_like(advantages, dtype=torch.float64)
    for rank, rank_micro_batches in enumerate(micro_batches):
        samples = [i for micro in rank_micro_batches for i in micro]
        whitened[samples] = whiten_over_ranks(advantages[samples], mask[samples],
                                              moments[rank], eps)
    return whitened


def critic_check(job: JobConfig, model_path: str, batch: RolloutBatch,
                 planted: Mapping[str, Planted]) -> CriticCheck | None:
    """trainer/verify.CriticCheck for a job with a critic, None without one; ``planted``:
    {layout name: its errors} (``local_whitening`` is planted here, the rest in ranks)."""
    from rollout.advantages import with_gae
    from services.driver.job import critic_model_path
    from trainer.step_plan import packs, plan_step
    from trainer.verify import CriticCheck, layout_config, rank_token_moments

    if not job.critic.enabled:
        return None
    advantage = job.rollout.advantage
    objective = job.objective_config()

    def batch_for_layout(layout: Layout, values: torch.Tensor) -> RolloutBatch:
        if not advantage.normalize:
            return with_gae(batch, values, advantage)
        config = layout_config(job.trainer, layout)
        plan = plan_step(batch, objective, config.dp_size, config.cp_size,
                         config.max_tokens_per_micro_batch, packed=packs(config),
                         shared_prefix=config.shares_prefix)

        def rank_moments(raw: torch.Tensor) -> torch.Tensor:
            """[dp, cp, 3] of GAE's raw advantages as this layout's ranks hold them."""
            return rank_token_moments(dataclasses.replace(batch, advantages=raw), plan,
                                      config.cp_size)

        layout_planted = planted.get(str(layout), NOTHING_PLANTED)
        if PlantedError.LOCAL_WHITENING not in layout_planted:  # production's whitening
            return with_gae(batch, values, advantage, rank_moments=rank_moments)
        raw = with_gae(batch, values, advantage.model_copy(update={"normalize": False}))
        gae_only = raw.advantages - batch.advantages
        whitened = whitened_for_layout(gae_only, raw.loss_mask, rank_moments(gae_only),
                                       plan.micro_batches, advantage.eps, layout_planted)
        return dataclasses.replace(raw, advantages=batch.advantages + whitened.float())

    return CriticCheck(job.critic_trainer_config(), job.critic_objective_config(),
                       critic_model_path(job, model_path), job.critic.value_clip,
                       batch_for_layout)
