r"""``ppo``: the clipped surrogate (Schulman et al. 2017), with clip-higher and dual clip.

With r_t = log π_θ(a_t) − log π_old(a_t), ρ_t = exp(r_t), advantage A_t:

    ℓ_t = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 − ε_low, 1 + ε_high))     ε_low = eps_clip,
                                                                  ε_high = eps_clip_high
    dual clip (dual_clip_c = c > 1, Ye et al. 2020): for A_t < 0, ℓ_t ← min(ℓ_t, −A_t·c)

A token counts as clipped where the clipped branch is strictly the larger. TIS (tis_cap)
and the other off-policy corrections multiply ℓ_t by their weight of π_old/π_rollout
(trainer/losses/rollout_correction.py, ``old_policy``).
"""

from __future__ import annotations

import torch

from trainer.losses.base import PolicyLoss, PolicyLossInputs, PolicyLossTerms, safe_exp_log_ratio


class PPO(PolicyLoss):
    rollout_correction = "old_policy"

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
        loss = torch.where(mask > 0, loss, torch.zeros_like(loss))
        return PolicyLossTerms(pg_loss=loss, clipped=was_clipped, ratio=ratio.detach())
