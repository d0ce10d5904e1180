r"""PPO with a learned critic: GAE per token. For sample i, take its valid tokens
(m_it > 0) in order, k = 1 … K (an environment's observation tokens, m = 0, are skipped:
the time axis is the policy's own tokens); r_k is the reward placed on token k (the
task's reward on the last token, an environment step's on the last token of its action),
V_k the critic's value at it, V_{K+1} = 0 (with ``bootstrap_truncated``, for a response
cut at the length limit, the batch's ``truncated``: V_{K+1} = V_K, the critic's estimate
of what the cut took away, where 0 would tell the critic the episode ended there):

    δ_k = r_k + γ · V_{k+1} − V_k
    A_k = δ_k + γλ · A_{k+1}                     (A_{K+1} = 0)
    R_k = A'_k + V_k, A' the same recursion with λ = critic_lam

R_k is the critic's target, built from the raw A' (never from whitened advantages).
VAPO (arXiv 2504.05118) decouples λ: critic_lam = 1 makes R_k the discounted Monte-Carlo
return, unbiased for the critic, while the policy keeps lam < 1 to lower its variance.
With ``normalize`` (AdvantageConfig: on by default for gae) A is whitened with the whole
rollout's moments, reduced over every rank (rollout/advantages/whitening.py
``whiten_over_ranks``).

An unscored sample (a reward part could not score it: the batch's ``scored``) has no
reward to propagate: its A is 0 on every token and its tokens stay out of the whitening
moments and the ``critic/*`` statistics; its critic target is its own value, R_k = V_k,
so the value loss is told nothing about it (a reward of 0 would teach the critic a
return it never saw).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from rollout.advantages.base import AdvantageEstimator, AdvantageInputs, scored_mask
from rollout.advantages.whitening import (
    explained_variance,
    moments_mean_std,
    token_moments,
    whiten_over_ranks,
)

if TYPE_CHECKING:
    from rollout.batch import RolloutBatch
    from rollout.config import AdvantageConfig

RankMoments = Callable[[torch.Tensor], torch.Tensor]
"""Raw A [N, S] -> every rank's (n, Σ A, Σ A²) [..., 3] of the tokens it holds."""


def gae(token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor,
        gamma: float, lam: float, bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """A_it [N, S] float64 of the module docstring's recursion over each sample's valid
    tokens (m_it > 0), right to left; 0 off them. Every argument [N, S], aligned;
    ``bootstrap`` [N] bool: the samples whose V_{K+1} is their V_K (cut responses)."""
    rewards, values = token_rewards.to(torch.float64), values.to(torch.float64)
    valid = loss_mask > 0
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=torch.float64)
    next_value = torch.zeros_like(running)
    if bootstrap is not None:  # V at each sample's last valid token (0 if it has none)
        width = values.shape[1]
        last = torch.where(valid, torch.arange(width), -1).amax(dim=1)
        at_last = values.gather(1, last.clamp(min=0)[:, None])[:, 0]
        next_value = torch.where(bootstrap.bool() & (last >= 0), at_last, 0.0)
    for t in range(values.shape[1] - 1, -1, -1):  # a hole carries both on unchanged
        here = valid[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        advantages[:, t] = torch.where(here, step, 0.0)
        running = torch.where(here, step, running)
        next_value = torch.where(here, values[:, t], next_value)
    return advantages


class GAE(AdvantageEstimator):
    """The module docstring's A (whitened when ``normalize``); :meth:`apply` also stores
    the critic's values and targets R and logs the critic's metrics."""

    needs_critic: ClassVar[bool] = True
    needs_token_rewards: ClassVar[bool] = True

    def __init__(self, gamma: float = 1.0, lam: float = 0.95, critic_lam: float = 1.0,
                 normalize: bool = False, eps: float = 1e-6,
                 bootstrap_truncated: bool = False) -> None:
        self.gamma, self.lam, self.critic_lam = gamma, lam, critic_lam
        self.normalize, self.eps = normalize, eps
        self.bootstrap_truncated = bootstrap_truncated

    @property
    def needs_truncation(self) -> bool:  # type: ignore[override]  # a setting here
        """With ``bootstrap_truncated`` its inputs carry the batch's cut flags."""
        return self.bootstrap_truncated

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        assert inputs.values is not None and inputs.token_rewards is not None
        raw = gae(inputs.token_rewards, inputs.values, inputs.loss_mask, self.gamma, self.lam,
                  inputs.truncated)
        mask = scored_mask(inputs.loss_mask, inputs.scored)
        return torch.where(mask > 0, self._whitened(raw, mask, None), 0.0).to(torch.float32)

    def _whitened(self, advantages: torch.Tensor, mask: torch.Tensor,
                  rank_moments: RankMoments | None) -> torch.Tensor:
        """A whitened when ``normalize``, by the moments of every rank: on the driver the
        inputs are the whole rollout, one "rank" (``rank_moments`` None); the verifier
        hands its layout's reduction (over the tokens of ``mask``: the scored samples')."""
        if not self.normalize:
            return advantages
        moments = (token_moments(advantages, mask) if rank_moments is None
                   else rank_moments(advantages))
        return whiten_over_ranks(advantages, mask, moments, self.eps)

    def apply(self, batch: RolloutBatch, rank_moments: RankMoments | None = None,
              truncated: torch.Tensor | None = None, **scored: Any) -> RolloutBatch:
        """The batch with the critic's ``values`` [N, S] (V at the rollout), A added to
        its advantages, the critic's targets R (``returns``) and the rollout's
        ``critic/explained_variance`` (of V before this step's updates),
        ``critic/returns_mean`` and ``critic/advantages_{mean,std}`` (before whitening).
        ``rank_moments``: the whitening's statistics of each rank (default: the batch's
        own, which on the driver is the whole rollout); ``truncated`` [N] bool: responses
        cut at the length limit, bootstrapped with V_{K+1} = V_K (None: the batch's own
        ``truncated`` with ``bootstrap_truncated``, else none is). An unscored sample
        (module docstring): A 0, R = V, out of every statistic."""
        inputs = self.inputs(batch, **scored)  # refuses a call without the values
        assert inputs.values is not None and inputs.token_rewards is not None
        truncated = truncated if truncated is not None else inputs.truncated
        values = torch.where(batch.loss_mask > 0, inputs.values.to(torch.float32), 0.0)
        mask = scored_mask(batch.loss_mask, batch.scored)  # the scored samples' tokens
        raw = gae(inputs.token_rewards, values, mask, self.gamma, self.lam, truncated)
        raw_mean, raw_std = moments_mean_std(token_moments(raw, mask))
        returns = gae(inputs.token_rewards, values, mask, self.gamma, self.critic_lam,
                      truncated)
        returns = torch.where(mask > 0, returns + values.double(), 0.0)
        returns = torch.where(batch.loss_mask > mask, values.double(), returns)  # unscored
        returns_mean, _ = moments_mean_std(token_moments(returns, mask))
        advantages = self.checked(self._whitened(raw, mask, rank_moments), mask)
        return dataclasses.replace(
            batch, advantages=batch.advantages + advantages, values=values,
            returns=returns.to(torch.float32), metadata={
                **batch.metadata,
                "critic/explained_variance": explained_variance(returns, values, mask),
                "critic/returns_mean": returns_mean,
                "critic/advantages_mean": raw_mean,
                "critic/advantages_std": raw_std})


def with_gae(batch: RolloutBatch, values: torch.Tensor, config: AdvantageConfig,
             rank_moments: RankMoments | None = None) -> RolloutBatch:
    """What the driver does with a PPO rollout: the estimator ``config`` builds (the
    registry's, as the driver's ``build_estimator``) applied to ``batch`` and the
    critic's ``values``; ``rank_moments`` as :meth:`GAE.apply`'s (the verifier's
    layouts)."""
    from rollout.advantages.registry import build_estimator  # it imports this module

    estimator = build_estimator(config)
    if not isinstance(estimator, GAE):
        raise ValueError(f"rollout.advantage.type: with_gae needs gae, not {config.type}")
    return estimator.apply(batch, rank_moments=rank_moments, values=values)
