r"""REINFORCE++ with a group baseline: the group-centred rewards whitened over the whole
batch (μ_g the mean reward of the group's scored samples S_g, ε = ``eps``, mean and
Bessel std over the batch's scored samples S, all N unless a reward part left some
unscored):

    a_i = r_i − μ_g;   A_i = (a_i − mean_S(a)) / (std_S(a) + ε)   on every token of i ∈ S
    A_i = 0                                                      i unscored (missing)
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rollout.advantages.base import AdvantageEstimator, AdvantageInputs, group_stats, per_token


def reinforce_pp_advantages(rewards: torch.Tensor, group_index: torch.Tensor,
                            eps: float = 1e-6, scored: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """REINFORCE++ with a group-mean baseline, whitened over the batch, shape [N];
    ``scored`` [N] bool (None: all): an unscored sample gets 0 and stays out of every
    statistic."""
    rewards = rewards.to(torch.float64)
    keep = (torch.ones_like(rewards, dtype=torch.bool) if scored is None
            else scored.bool())
    mean, _ = group_stats(rewards, group_index, keep)
    centered = (rewards - mean)[keep]
    batch_std = centered.std() if centered.numel() > 1 else torch.zeros((), dtype=torch.float64)
    batch_mean = centered.mean() if centered.numel() else torch.zeros((), dtype=torch.float64)
    out = torch.zeros_like(rewards)
    out[keep] = (centered - batch_mean) / (batch_std + eps)
    return out.to(torch.float32)


class ReinforcePP(AdvantageEstimator):
    """The module docstring's A_i on every token of sample i."""

    needs_reward_spread: ClassVar[bool] = True

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        return per_token(reinforce_pp_advantages(inputs.rewards, inputs.group_index,
                                                 self.eps, inputs.scored), inputs.loss_mask)
