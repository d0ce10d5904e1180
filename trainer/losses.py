r"""Per-token loss terms. Each returns ℓ_it; trainer/aggregation.py turns them into J.

With log-ratio r_t = log π_θ(a_t) − log π_old(a_t), ratio ρ_t = exp(r_t) and advantage A:

    PPO clip     ℓ = max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))
    dual clip    for A < 0: ℓ = min(ℓ, −A·c)                    (c > 1, Ye et al. 2020)
    TIS          ℓ ← min(π_old / π_rollout, cap) · ℓ             (weight detached)
    KL (to ref)  with δ = log π_ref − log π_θ:
                 k1 = −δ,  k2 = δ²/2,  k3 = exp(δ) − 1 − δ,  low_var_kl = clamp(k3, −10, 10)
    entropy      H_t = −Σ_v p_v log p_v                          (a bonus: subtracted)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.config import LossConfig


@dataclass
class PolicyLossTerms:
    """Per-token values [.., T] of one micro-batch (shard)."""

    pg_loss: torch.Tensor
    clipped: torch.Tensor
    """1.0 where the clipped branch is active (for the clip fraction), else 0."""
    ratio: torch.Tensor


def policy_gradient_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config: LossConfig,
    rollout_log_probs: torch.Tensor | None = None,
) -> PolicyLossTerms:
    """PPO clipped surrogate per token, with optional dual clip and TIS."""
    ratio = torch.exp(log_probs - old_log_probs)
    eps_high = config.eps_clip_high if config.eps_clip_high is not None else config.eps_clip
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.eps_clip, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).to(log_probs.dtype)
    if config.dual_clip_c is not None:
        dual_bound = -advantages * config.dual_clip_c
        loss = torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss)
    if config.tis_cap is not None and rollout_log_probs is not None:
        tis_weight = torch.exp(old_log_probs - rollout_log_probs).clamp(max=config.tis_cap)
        loss = loss * tis_weight.detach()
    return PolicyLossTerms(pg_loss=loss, clipped=was_clipped, ratio=ratio.detach())


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from sampled tokens."""
    delta = ref_log_probs - log_probs
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    k3 = torch.exp(delta) - 1 - delta
    if estimator == "k3":
        return k3
    if estimator == "low_var_kl":
        return k3.clamp(-10, 10)
    raise ValueError(f"kl_estimator: unknown estimator {estimator!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the softmax over the vocabulary: [.., T, V] -> [.., T]."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position: logits [.., T, V], targets [.., T] -> [.., T]."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
