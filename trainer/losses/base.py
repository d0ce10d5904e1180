r"""The interface every policy loss implements: the pg term's per-token loss ℓ_it.

A policy loss sees one micro-batch shard's tensors [.., T] and returns ℓ_it per token
(0 where masked); trainer/aggregation.py's weights turn it into J. It never aggregates:
summing over tokens, samples or ranks is the objective's, so a loss is exact under every
layout by construction.

Log-probs are those of the *sampling* distribution π_T = softmax(z / T), in fp32 (or
fp64) whatever the compute dtype. NaN safety: masked positions are zeroed *before* any
``exp`` (a ``where`` after an overflowing ``exp`` still back-propagates 0·inf = NaN) and
every log-ratio is clamped to ±``MAX_LOG_RATIO`` first (:func:`safe_exp_log_ratio`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.config import LossConfig

MAX_LOG_RATIO = 20.0
"""exp(±20) is finite in fp32 with room to multiply; beyond it a ratio means nothing."""


@dataclass
class PolicyLossInputs:
    """What a policy loss may read, per token [.., T] of one micro-batch shard."""

    log_probs: torch.Tensor
    """log π_θ(a_t), differentiable."""
    old_log_probs: torch.Tensor
    """log π_old(a_t): the policy at the rollout's start (``trainer.loss.old_log_probs``)."""
    advantages: torch.Tensor
    """A_t (a per-sample advantage is a row of equal values)."""
    loss_mask: torch.Tensor
    """m_t: 0 on tokens that are not the policy's; may be fractional."""
    rollout_log_probs: torch.Tensor | None = None
    """log π_rollout(a_t), the engine's log-probs of the sampled tokens."""


@dataclass
class PolicyLossTerms:
    """Per-token values [.., T] of one micro-batch (shard)."""

    pg_loss: torch.Tensor
    """ℓ_t, 0 where masked."""
    clipped: torch.Tensor
    """1.0 where the clipped (or truncated) branch is active, else 0: the clip fraction."""
    ratio: torch.Tensor
    """ρ_t without a graph (1 where the loss has none): logged as mean |ρ − 1|."""


class PolicyLoss:
    """The base of every policy loss, built-in or a user's (``trainer.loss.class_path``
    must name a subclass, checked in the job's preflight, so a config can never make the
    ranks call an arbitrary callable). Built with the loss config and, for a user's class,
    ``trainer.loss.kwargs`` as keyword arguments; called once per micro-batch shard."""

    def __init__(self, config: LossConfig) -> None:
        self.config = config

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossTerms:
        raise NotImplementedError(f"{type(self).__name__} must define __call__")


def safe_exp_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(clamp(r)) where mask is set and exp(0) = 1 elsewhere; finite in both passes."""
    masked = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))
    return torch.exp(masked.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
