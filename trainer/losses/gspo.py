r"""``gspo``: Group Sequence Policy Optimization (Zheng et al. 2025), in its token form.

With r_t = log π_θ(y_t) − log π_old(y_t) over the valid tokens (m_t > 0) of sample i, its
sequence ratio and GSPO's token form of it:

    s_i  = exp((1/|y_i|) Σ_t r_t)                      (|y_i|: its valid tokens)
    s_it = sg(s_i) · π_θ(y_t) / sg(π_θ(y_t))           (value s_i, ∇s_it = s_i ∇log π_θ(y_t))
    ℓ_t  = max(−A_t·s_it, −A_t·clip(s_it, 1 − ε_low, 1 + ε_high))
                                                       ε_low = eps_clip, ε_high = eps_clip_high

The clip is decided by s_i (the value of every s_it of the sample): a clipped sample's
tokens get no gradient. Under sample_mean (w_t = 1/(N·|y_i|)) and a per-sample A_i this is
the paper's sequence gradient −(1/N) Σ_i s_i·A_i·(1/|y_i|) Σ_t ∇log π_θ(y_t) for an
unclipped sample; every aggregation mode still applies, since ℓ_t is per token. Σ_t runs
over the sample's whole response on every CP rank and packed piece
(``PolicyLossInputs.sample_mean``). Defaults ε_low = 3e-4, ε_high = 4e-4 (the paper's)
when neither eps_clip nor eps_clip_high is set. A token counts as clipped where the
clipped branch is strictly the larger; the logged ratio is s_i.
"""

from __future__ import annotations

import torch

from trainer.losses.base import MAX_LOG_RATIO, PolicyLoss, PolicyLossInputs, PolicyLossTerms


class GSPO(PolicyLoss):
    rollout_correction = "old_policy"

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossTerms:
        config, mask, advantages = self.config, inputs.loss_mask, inputs.advantages
        valid = mask > 0
        log_ratio = torch.where(valid, inputs.log_probs - inputs.old_log_probs, 0.0)
        sequence = torch.exp(inputs.sample_mean(log_ratio).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        own = torch.where(valid, inputs.log_probs, 0.0)  # a masked log-prob may be −inf
        ratio = sequence * torch.exp(own - own.detach())
        eps_high = config.eps_clip_high if config.eps_clip_high is not None else config.eps_clip
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1 - config.eps_clip, 1 + eps_high)
        loss = torch.where(valid, torch.maximum(unclipped, clipped), 0.0)
        was_clipped = ((clipped > unclipped) & valid).to(inputs.log_probs.dtype)
        return PolicyLossTerms(pg_loss=loss, clipped=was_clipped,
                               ratio=torch.where(valid, sequence, 1.0))
