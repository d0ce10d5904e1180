r"""``importance_sampling``: REINFORCE on the engine's samples, importance-weighted.

With q_t = π_rollout(a_t) (the engine's probability of the sampled token; the policy's
own, detached, when the batch has none) and ρ_t = π_θ(a_t) / q_t:

    ℓ_t = −A_t · ρ_t · sg(min(ρ_t, cap) / ρ_t)

whose value is −A_t·min(ρ_t, cap) and gradient −A_t·min(ρ_t, cap)·∇log π_θ(a_t)
(cap = tis_cap; no truncation when unset). A token counts as clipped where it is
truncated (ρ_t > cap).
"""

from __future__ import annotations

import torch

from trainer.losses.base import PolicyLoss, PolicyLossInputs, PolicyLossTerms, safe_exp_log_ratio


class ImportanceSampling(PolicyLoss):
    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossTerms:
        mask, log_probs = inputs.loss_mask, inputs.log_probs
        sampled = (inputs.rollout_log_probs if inputs.rollout_log_probs is not None
                   else log_probs.detach())
        ratio = safe_exp_log_ratio(log_probs - sampled, mask)
        truncation = torch.ones_like(ratio)
        if self.config.tis_cap is not None:
            truncation = (ratio.clamp(max=self.config.tis_cap) / ratio).detach()
        zeros = torch.zeros_like(log_probs)
        loss = torch.where(mask > 0, -inputs.advantages * ratio * truncation, zeros)
        truncated = ((truncation < 1) & (mask > 0)).to(log_probs.dtype)
        return PolicyLossTerms(pg_loss=loss, clipped=truncated, ratio=ratio.detach())
