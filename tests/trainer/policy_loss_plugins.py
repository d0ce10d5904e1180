"""Policy losses written as a user would (``trainer.loss.class_path``), for the tests.

``ClippedPPO`` is PPO's clipped surrogate written apart from trainer/losses/ppo.py, in
the textbook form ℓ_t = −min(ρ_t·A_t, clip(ρ_t, 1 − ε, 1 + ε)·A_t)."""

from __future__ import annotations

import torch

from trainer.config import LossConfig
from trainer.losses import PolicyLoss, PolicyLossInputs, PolicyLossTerms


class ClippedPPO(PolicyLoss):
    def __init__(self, config: LossConfig, eps: float = 0.2) -> None:
        super().__init__(config)
        self.eps = eps

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossTerms:
        valid = inputs.loss_mask > 0
        # zeroed before exp, so a masked position can never overflow into the gradient
        ratio = torch.where(valid, inputs.log_probs - inputs.old_log_probs, 0.0).exp()
        advantages = inputs.advantages
        surrogate = ratio * advantages
        clipped_surrogate = ratio.clamp(1 - self.eps, 1 + self.eps) * advantages
        loss = torch.where(valid, -torch.minimum(surrogate, clipped_surrogate), 0.0)
        clipped = (clipped_surrogate < surrogate) & valid
        return PolicyLossTerms(pg_loss=loss, clipped=clipped.to(loss.dtype),
                               ratio=ratio.detach())


def not_a_class(inputs: PolicyLossInputs) -> torch.Tensor:
    """A function where a PolicyLoss subclass is required."""
    return -inputs.log_probs


class NotAPolicyLoss:
    """A callable class that does not subclass PolicyLoss."""

    def __call__(self, inputs: PolicyLossInputs) -> torch.Tensor:
        return -inputs.log_probs
