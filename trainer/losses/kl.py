r"""The KL penalty to the reference policy, per token, from the sampled tokens.

With δ_t = log π_ref(a_t) − log π_θ(a_t) (Schulman's estimators of KL(π_θ ‖ π_ref)):

    k1 = −δ,   k2 = δ²/2,   k3 = exp(δ) − 1 − δ,   low_var_kl = clamp(k3, −10, 10)

δ is zeroed where masked and clamped to ±MAX_LOG_RATIO before ``exp`` (trainer/losses/base.py).
"""

from __future__ import annotations

import torch

from trainer.losses.base import MAX_LOG_RATIO


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str,
    loss_mask: torch.Tensor,
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from sampled tokens; 0 where masked."""
    delta = ref_log_probs - log_probs
    delta = torch.where(loss_mask > 0, delta, torch.zeros_like(delta))
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    delta = delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    k3 = torch.exp(delta) - 1 - delta
    if estimator == "k3":
        return k3
    if estimator == "low_var_kl":
        return k3.clamp(-10, 10)
    raise ValueError(f"kl_estimator: unknown estimator {estimator!r}")
