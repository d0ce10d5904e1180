r"""REINFORCE++ with a group baseline: the group-centred rewards whitened over the whole
batch (μ_g the group's mean reward, ε = ``eps``, mean and Bessel std over all N):

    a_i = r_i − μ_g;   A_i = (a_i − mean(a)) / (std(a) + ε)   on every token of sample i
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rollout.advantages.base import AdvantageEstimator, AdvantageInputs, group_stats, per_token


def reinforce_pp_advantages(rewards: torch.Tensor, group_index: torch.Tensor,
                            eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with a group-mean baseline, whitened over the batch, shape [N]."""
    rewards = rewards.to(torch.float64)
    mean, _ = group_stats(rewards, group_index)
    centered = rewards - mean
    batch_std = centered.std() if centered.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return ((centered - centered.mean()) / (batch_std + eps)).to(torch.float32)


class ReinforcePP(AdvantageEstimator):
    """The module docstring's A_i on every token of sample i."""

    needs_reward_spread: ClassVar[bool] = True

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        return per_token(reinforce_pp_advantages(inputs.rewards, inputs.group_index,
                                                 self.eps), inputs.loss_mask)
