r"""``cispo``: Clipped IS-weight Policy Optimization (MiniMax-M1, 2025; TRL's ``cispo``).

With ρ_t = π_θ(a_t) / π_old(a_t) and ε_high = eps_clip_high (eps_clip when unset):

    ℓ_t = −sg(min(ρ_t, 1 + ε_high)) · A_t · log π_θ(a_t)

REINFORCE weighted by the truncated, detached ratio: gradient
−min(ρ_t, 1 + ε_high)·A_t·∇log π_θ(a_t), so unlike PPO's clip every token keeps a
gradient. A token counts as clipped where ρ_t > 1 + ε_high.
"""

from __future__ import annotations

import torch

from trainer.losses.base import PolicyLoss, PolicyLossInputs, PolicyLossTerms, safe_exp_log_ratio


class CISPO(PolicyLoss):
    rollout_correction = "old_policy"

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossTerms:
        config, mask = self.config, inputs.loss_mask
        valid = mask > 0
        ratio = safe_exp_log_ratio(inputs.log_probs - inputs.old_log_probs, mask).detach()
        cap = 1 + (config.eps_clip_high if config.eps_clip_high is not None
                   else config.eps_clip)
        own = torch.where(valid, inputs.log_probs, 0.0)  # a masked log-prob may be −inf
        loss = torch.where(valid, -ratio.clamp(max=cap) * inputs.advantages * own, 0.0)
        return PolicyLossTerms(pg_loss=loss, clipped=((ratio > cap) & valid).to(own.dtype),
                               ratio=ratio)
