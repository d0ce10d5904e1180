r"""GRPO: a group baseline. Sample i of group g has reward r_i; μ_g and σ_g are the mean
and standard deviation (Bessel-corrected, 0 for a group of one) of the rewards in g,
ε = ``eps``; every token of the sample gets

    A_i = (r_i − μ_g) / (σ_g + ε)      normalize_std=True   (GRPO)
    A_i =  r_i − μ_g                   normalize_std=False  (Dr. GRPO)

A group whose rewards are all equal has A_i = 0: it carries no signal, which is why
dynamic sampling drops such groups.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rollout.advantages.base import AdvantageEstimator, AdvantageInputs, group_stats, per_token


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor,
                    normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (or Dr. GRPO with normalize_std=False) advantages, shape [N]."""
    rewards = rewards.to(torch.float64)  # the sums are exact enough to hand-check
    mean, std = group_stats(rewards, group_index)
    centered = rewards - mean
    out = centered / (std + eps) if normalize_std else centered
    return out.to(torch.float32)


class GRPO(AdvantageEstimator):
    """The module docstring's A_i on every token of sample i."""

    needs_reward_spread: ClassVar[bool] = True

    def __init__(self, normalize_std: bool = True, eps: float = 1e-6) -> None:
        self.normalize_std, self.eps = normalize_std, eps

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        advantages = grpo_advantages(inputs.rewards, inputs.group_index, self.normalize_std,
                                     self.eps)
        return per_token(advantages, inputs.loss_mask)
