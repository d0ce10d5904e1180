r"""``ppo``: the clipped surrogate (Schulman et al. 2017), with clip-higher, dual clip and TIS.

With r_t = log π_θ(a_t) − log π_old(a_t), ρ_t = exp(r_t), advantage A_t:

    ℓ_t = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 − ε_low, 1 + ε_high))     ε_low = eps_clip,
                                                                  ε_high = eps_clip_high
    dual clip (dual_clip_c = c > 1, Ye et al. 2020): for A_t < 0, ℓ_t ← min(ℓ_t, −A_t·c)
    TIS (tis_cap): ℓ_t ← sg(min(π_old / π_rollout, cap)) · ℓ_t

A token counts as clipped where the clipped branch is strictly the larger.
"""

from __future__ import annotations

import torch

from trainer.losses.base import PolicyLoss, PolicyLossInputs, PolicyLossTerms, safe_exp_log_ratio


class PPO(PolicyLoss):
    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossTerms:
        config, mask, advantages = self.config, inputs.loss_mask, inputs.advantages
        ratio = safe_exp_log_ratio(inputs.log_probs - inputs.old_log_probs, mask)
        eps_high = config.eps_clip_high if config.eps_clip_high is not None else config.eps_clip
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1 - config.eps_clip, 1 + eps_high)
        loss = torch.maximum(unclipped, clipped)
        was_clipped = ((clipped > unclipped) & (mask > 0)).to(inputs.log_probs.dtype)
        if config.dual_clip_c is not None:
            dual_bound = -advantages * config.dual_clip_c
            loss = torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss)
        if config.tis_cap is not None and inputs.rollout_log_probs is not None:
            tis_weight = safe_exp_log_ratio(inputs.old_log_probs - inputs.rollout_log_probs,
                                            mask)
            loss = loss * tis_weight.clamp(max=config.tis_cap).detach()
        loss = torch.where(mask > 0, loss, torch.zeros_like(loss))
        return PolicyLossTerms(pg_loss=loss, clipped=was_clipped, ratio=ratio.detach())
