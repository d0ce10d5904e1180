r"""Per-token loss terms. Each returns ℓ_it; trainer/aggregation.py turns them into J.

Log-probs and entropy are those of the *sampling* distribution π_T = softmax(z / T), in
fp32 whatever the compute dtype: the samples come from π_T, so the PPO ratio, TIS, KL and
the gradient must be taken for it too.

With log-ratio r_t = log π_θ(a_t) − log π_old(a_t), ratio ρ_t = exp(r_t) and advantage A:

    PPO clip     ℓ = max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))
    dual clip    for A < 0: ℓ = min(ℓ, −A·c)                    (c > 1, Ye et al. 2020)
    TIS          ℓ ← min(π_old / π_rollout, cap) · ℓ             (weight detached)
    IS (REINFORCE) with q_t = exp(log π_rollout(a_t)), ρ_q = π_θ / q:
                 ℓ = −A·ρ_q·sg(min(ρ_q, cap)/ρ_q)    value −A·min(ρ_q, cap), gradient
                                                     −A·min(ρ_q, cap)·∇log π_θ
    cross entropy ℓ = −log π_θ(a_t)                               (SFT; A unused)
    KL (to ref)  with δ = log π_ref − log π_θ:
                 k1 = −δ,  k2 = δ²/2,  k3 = exp(δ) − 1 − δ,  low_var_kl = clamp(k3, −10, 10)
    entropy      H_t = −Σ_v p_v log p_v                          (a bonus: subtracted)

NaN safety: masked positions are zeroed *before* any ``exp`` (the double-where trick: a
``where`` after an overflowing ``exp`` still back-propagates 0·inf = NaN), and every
log-ratio is clamped to ±``MAX_LOG_RATIO`` before ``exp`` (as verl does), so no term
overflows; entropy treats p·log p as 0 where p = 0 (logits of −inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.config import LossConfig

MAX_LOG_RATIO = 20.0
"""exp(±20) is finite in fp32 with room to multiply; beyond it a ratio means nothing."""


@dataclass
class PolicyLossTerms:
    """Per-token values [.., T] of one micro-batch (shard)."""

    pg_loss: torch.Tensor
    clipped: torch.Tensor
    """1.0 where the clipped branch is active (for the clip fraction), else 0."""
    ratio: torch.Tensor


def safe_exp_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(clamp(r)) where mask is set and exp(0) = 1 elsewhere; finite in both passes."""
    masked = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))
    return torch.exp(masked.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def policy_gradient_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config: LossConfig,
    loss_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None = None,
) -> PolicyLossTerms:
    """The pg term per token (``config.policy_loss``): the PPO clipped surrogate with
    optional dual clip and TIS, importance-sampled REINFORCE or cross entropy; 0 where
    masked."""
    if config.policy_loss != "ppo":
        return _reinforce_or_cross_entropy(log_probs, advantages, config, loss_mask,
                                           rollout_log_probs)
    ratio = safe_exp_log_ratio(log_probs - old_log_probs, loss_mask)
    eps_high = config.eps_clip_high if config.eps_clip_high is not None else config.eps_clip
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.eps_clip, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = ((clipped > unclipped) & (loss_mask > 0)).to(log_probs.dtype)
    if config.dual_clip_c is not None:
        dual_bound = -advantages * config.dual_clip_c
        loss = torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss)
    if config.tis_cap is not None and rollout_log_probs is not None:
        tis_weight = safe_exp_log_ratio(old_log_probs - rollout_log_probs, loss_mask)
        loss = loss * tis_weight.clamp(max=config.tis_cap).detach()
    loss = torch.where(loss_mask > 0, loss, torch.zeros_like(loss))
    return PolicyLossTerms(pg_loss=loss, clipped=was_clipped, ratio=ratio.detach())


def _reinforce_or_cross_entropy(
    log_probs: torch.Tensor, advantages: torch.Tensor, config: LossConfig,
    loss_mask: torch.Tensor, rollout_log_probs: torch.Tensor | None,
) -> PolicyLossTerms:
    """``policy_loss`` importance_sampling or cross_entropy (module docstring)."""
    zeros = torch.zeros_like(log_probs)
    if config.policy_loss == "cross_entropy":
        loss = torch.where(loss_mask > 0, -log_probs, zeros)
        return PolicyLossTerms(pg_loss=loss, clipped=zeros, ratio=torch.ones_like(zeros))
    sampled = rollout_log_probs if rollout_log_probs is not None else log_probs.detach()
    ratio = safe_exp_log_ratio(log_probs - sampled, loss_mask)
    truncation = torch.ones_like(ratio)
    if config.tis_cap is not None:
        truncation = (ratio.clamp(max=config.tis_cap) / ratio).detach()
    loss = torch.where(loss_mask > 0, -advantages * ratio * truncation, zeros)
    truncated = ((truncation < 1) & (loss_mask > 0)).to(log_probs.dtype)
    return PolicyLossTerms(pg_loss=loss, clipped=truncated, ratio=ratio.detach())


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


def tempered_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(z / T) in fp32 (fp64 stays fp64): [.., V] -> [.., V]."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def entropy_from_log_probs(log_p: torch.Tensor) -> torch.Tensor:
    """H = −Σ p log p over the last dim, with p log p := 0 where p = 0 (log p = −inf)."""
    finite = torch.isfinite(log_p)
    safe_log_p = torch.where(finite, log_p, torch.zeros_like(log_p))
    return -(torch.where(finite, safe_log_p.exp() * safe_log_p, 0.0)).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token entropy of softmax(z / T): [.., T, V] -> [.., T]."""
    return entropy_from_log_probs(tempered_log_softmax(logits, temperature))


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """log π_T(target) per position: logits [.., T, V], targets [.., T] -> [.., T]."""
    log_p = tempered_log_softmax(logits, temperature)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          with_entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One log-softmax for both: log π_T(target) and H(π_T) per position."""
    log_p = tempered_log_softmax(logits, temperature)
    token = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(with_entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_log_probs(log_p if with_entropy_grad else log_p.detach())
    return token, entropy


def loss_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Where a backend computes logits: the loss mask's positions [b, s] (bool). A shard
    with none keeps its first position, so its backward still reaches every parameter
    (FSDP's reduce-scatter needs every rank) with a zero gradient."""
    keep = loss_mask > 0
    if not keep.any():
        keep = keep.clone()
        keep.view(-1)[0] = True
    return keep


def spread(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Values [n] at the n positions ``keep`` [b, s] marks, 0 elsewhere: [b, s]."""
    return values.new_zeros(keep.shape).masked_scatter(keep, values)
