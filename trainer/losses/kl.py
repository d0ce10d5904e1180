r"""The KL penalty to the reference policy, per token, from the sampled tokens.

With δ = log π_ref(y) − log π_θ(y), y ~ π (Schulman's estimators of KL(π ‖ π_ref)):

    k1  = −δ                     E_π[k1] = KL(π‖ref)   E_π[∇k1] = 0
    k2  = δ²/2                   E_π[k2] ≈ KL(π‖ref)   E_π[∇k2] = ∇KL(π‖ref)
    k3  = exp(δ) − 1 − δ         E_π[k3] = KL(π‖ref)   E_π[∇k3] = ∇KL(ref‖π)
    k3+ = k3 in value, k2 in gradient (straight-through: sg(k3) + (k2 − sg(k2)))
    low_var_kl = clamp(k3, −10, 10)   (verl's name; k3's expectations while no k3 > 10)

E_π[∇k] is the expected gradient of k as a loss term: y ~ π, the sampling not
differentiated, Σ_y sg(π(y)) ∇k(y). Since ∇k1 = ∇log π, ∇k2 = −δ ∇log π and
∇k3 = (1 − ref/π) ∇log π, and Σ π ∇log π = 0: k1's is 0, k2's is Σ π log(π/ref) ∇log π
= ∇KL(π‖ref) (the reverse KL, the penalty the docs promise), k3's is −Σ ref ∇log π =
∇KL(ref‖π) (the forward KL). So as a loss only k2 and k3+ descend KL(π‖ref); E_π[k2] is
½E_π[log²(π/ref)], KL's second-order approximation, hence k3+ for an unbiased value.
Held by tests/trainer/test_kl_estimators.py (exact sums over a small vocabulary).

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
    k2 = 0.5 * delta.square()
    if estimator == "k2":
        return k2
    clamped = delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    k3 = torch.exp(clamped) - 1 - clamped
    if estimator == "k3":
        return k3
    if estimator == "low_var_kl":
        return k3.clamp(-10, 10)
    if estimator == "k3+":
        return k3.detach() + (k2 - k2.detach())  # value k3 exactly: the bracket is 0
    raise ValueError(f"kl_estimator: unknown estimator {estimator!r}")
