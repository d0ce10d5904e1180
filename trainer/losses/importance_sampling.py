r"""``importance_sampling``: REINFORCE on the engine's samples, importance-weighted.

With q_t = π_rollout(a_t) (the engine's probability of the sampled token; the policy's
own, detached, when the batch has none) and ρ_t = π_θ(a_t) / q_t:

    ℓ_t = −A_t · ρ_t

value −A_t·ρ_t, gradient −A_t·ρ_t·∇log π_θ(a_t). Its ratio is to π_rollout, so its π_old
is π_θ: ``trainer.loss.rollout_correction`` (trainer/losses/rollout_correction.py,
``own_ratio``) replaces ρ_t by the corrected weight W_t in value and gradient,
ℓ_t = −A_t·ρ_t·sg(W_t/ρ_t); with tis_cap c, W_t = min(ρ_t, c). A token counts as clipped
where the correction lowered its weight.
"""

from __future__ import annotations

import torch

from trainer.losses.base import PolicyLoss, PolicyLossInputs, PolicyLossTerms, safe_exp_log_ratio


class ImportanceSampling(PolicyLoss):
    rollout_correction = "own_ratio"

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossTerms:
        mask, log_probs = inputs.loss_mask, inputs.log_probs
        sampled = (inputs.rollout_log_probs if inputs.rollout_log_probs is not None
                   else log_probs.detach())
        ratio = safe_exp_log_ratio(log_probs - sampled, mask)
        zeros = torch.zeros_like(log_probs)
        loss = torch.where(mask > 0, -inputs.advantages * ratio, zeros)
        return PolicyLossTerms(pg_loss=loss, clipped=zeros, ratio=ratio.detach())
