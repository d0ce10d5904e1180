r"""The interface every policy loss implements: the pg term's per-token loss ℓ_it.

A policy loss sees one micro-batch shard's tensors [.., T] and returns ℓ_it per token
(0 where masked); trainer/aggregation.py's weights turn it into J. It never aggregates:
summing over tokens, samples or ranks is the objective's, so a loss is exact under every
layout by construction.

Log-probs are those of the *sampling* distribution π_T = softmax(z / T), in fp32 (or
fp64) whatever the compute dtype. NaN safety: masked positions are zeroed *before* any
``exp`` (a ``where`` after an overflowing ``exp`` still back-propagates 0·inf = NaN) and
every log-ratio is clamped to ±``MAX_LOG_RATIO`` first (:func:`safe_exp_log_ratio`).

Sequence quantities (GSPO's ratio, a sequence-level rollout correction) need a sample's
whole response, which CP ranks and packed rows split: a loss reads them only through
``PolicyLossInputs.sample_sum`` (each token gets its sample's total over every CP rank,
without a graph; trainer/objective.py's ``sample_sums``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

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
    per_sample_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    """values [.., T] -> [.., T], each token holding its sample's total over all its
    tokens (every CP rank's, every packed piece), detached; None: a row is a sample and
    holds all of it (one process, padded)."""

    def sample_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Each token's sample's total of ``values`` (detached): ``per_sample_sum``, or the
        row's sum when none is given."""
        values = values.detach()
        if self.per_sample_sum is not None:
            return self.per_sample_sum(values)
        return values.sum(dim=-1, keepdim=True).expand_as(values)

    def sample_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Each token's sample's mean of ``values`` over its valid tokens (m_t > 0, each
        counted once whatever its weight), detached; 0 for a sample with none."""
        valid = (self.loss_mask > 0).to(values.dtype)
        total = self.sample_sum(torch.where(valid > 0, values.detach(), 0.0))
        return total / self.sample_sum(valid).clamp(min=1)


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

    rollout_correction: ClassVar[Literal["old_policy", "own_ratio"] | None] = None
    """How ``trainer.loss.rollout_correction`` applies (trainer/losses/rollout_correction.py):
    ``old_policy``, ℓ_t is multiplied by the corrected weight of π_old/π_rollout;
    ``own_ratio``, the loss's ratio is π_θ/π_rollout itself, so π_old is π_θ and ℓ_t is
    multiplied by corrected / token ratio; None (a user's class unless it opts in, and
    cross_entropy), never corrected."""

    def __init__(self, config: LossConfig) -> None:
        self.config = config

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossTerms:
        raise NotImplementedError(f"{type(self).__name__} must define __call__")


def safe_exp_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(clamp(r)) where mask is set and exp(0) = 1 elsewhere; finite in both passes."""
    masked = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))
    return torch.exp(masked.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
