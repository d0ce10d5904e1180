r"""GRPO: a group baseline. Sample i of group g has reward r_i; S_g are the group's
scored samples (all of them unless a reward part left some unscored); μ_g and σ_g are the
mean and standard deviation (Bessel-corrected, 0 for one sample) of the rewards in S_g,
ε = ``eps``; every token of the sample gets

    A_i = (r_i − μ_g) / (σ_g + ε)      normalize_std=True   (GRPO)
    A_i =  r_i − μ_g                   normalize_std=False  (Dr. GRPO)
    A_i = 0                            i unscored (missing, not a zero reward)

so a group with an unscored member gets exactly GRPO over its scored members (TRL treats
an unscorable sample so). A group whose scored rewards are all equal has A_i = 0: it
carries no signal, which is why dynamic sampling drops such groups.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rollout.advantages.base import AdvantageEstimator, AdvantageInputs, group_stats, per_token


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor,
                    normalize_std: bool = True, eps: float = 1e-6,
                    scored: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO (or Dr. GRPO with normalize_std=False) advantages, shape [N]; ``scored`` [N]
    bool (None: all): an unscored sample gets 0 and stays out of μ_g and σ_g."""
    rewards = rewards.to(torch.float64)  # the sums are exact enough to hand-check
    mean, std = group_stats(rewards, group_index, scored)
    centered = rewards - mean
    out = centered / (std + eps) if normalize_std else centered
    if scored is not None:
        out = torch.where(scored.bool(), out, 0.0)
    return out.to(torch.float32)


class GRPO(AdvantageEstimator):
    """The module docstring's A_i on every token of sample i."""

    needs_reward_spread: ClassVar[bool] = True

    def __init__(self, normalize_std: bool = True, eps: float = 1e-6) -> None:
        self.normalize_std, self.eps = normalize_std, eps

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        advantages = grpo_advantages(inputs.rewards, inputs.group_index, self.normalize_std,
                                     self.eps, inputs.scored)
        return per_token(advantages, inputs.loss_mask)
