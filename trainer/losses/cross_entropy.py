r"""``cross_entropy``: supervised fine-tuning on the batch's tokens.

    ℓ_t = −log π_θ(a_t)

Advantages and the old policy are unused; nothing is clipped and the ratio is 1.
"""

from __future__ import annotations

import torch

from trainer.losses.base import PolicyLoss, PolicyLossInputs, PolicyLossTerms


class CrossEntropy(PolicyLoss):
    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossTerms:
        zeros = torch.zeros_like(inputs.log_probs)
        loss = torch.where(inputs.loss_mask > 0, -inputs.log_probs, zeros)
        return PolicyLossTerms(pg_loss=loss, clipped=zeros, ratio=torch.ones_like(zeros))
