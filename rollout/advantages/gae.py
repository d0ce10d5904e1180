r"""PPO with a learned critic: GAE per token. For sample i, take its valid tokens
(m_it > 0) in order, k = 1 … K (an environment's observation tokens, m = 0, are skipped:
the time axis is the policy's own tokens); r_k is the reward placed on token k (the
task's reward on the last token, an environment step's on the last token of its action),
V_k the critic's value at it, V_{K+1} = 0:

    δ_k = r_k + γ · V_{k+1} − V_k
    A_k = δ_k + γλ · A_{k+1}                     (A_{K+1} = 0)
    R_k = A'_k + V_k, A' the same recursion with λ = critic_lam

R_k is the critic's target. VAPO (arXiv 2504.05118) decouples λ: critic_lam = 1 makes R_k
the discounted Monte-Carlo return, unbiased for the critic, while the policy keeps
lam < 1 to lower its variance. With ``normalize`` A is whitened with the whole rollout's
moments (rollout/advantages/whitening.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from rollout.advantages.base import AdvantageEstimator, AdvantageInputs
from rollout.advantages.whitening import (
    explained_variance,
    moments_mean_std,
    token_moments,
    whiten,
)

if TYPE_CHECKING:
    from rollout.batch import RolloutBatch
    from rollout.config import AdvantageConfig


def gae(token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor,
        gamma: float, lam: float) -> torch.Tensor:
    """A_it [N, S] float64 of the module docstring's recursion over each sample's valid
    tokens (m_it > 0), right to left; 0 off them. Every argument [N, S], aligned."""
    rewards, values = token_rewards.to(torch.float64), values.to(torch.float64)
    valid = loss_mask > 0
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=torch.float64)
    next_value = torch.zeros_like(running)
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
                 normalize: bool = False, eps: float = 1e-6) -> None:
        self.gamma, self.lam, self.critic_lam = gamma, lam, critic_lam
        self.normalize, self.eps = normalize, eps

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        assert inputs.values is not None and inputs.token_rewards is not None
        raw = gae(inputs.token_rewards, inputs.values, inputs.loss_mask, self.gamma, self.lam)
        return self._whitened(raw, inputs.loss_mask)

    def _whitened(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.normalize:  # the inputs are the whole rollout: its moments are global
            advantages = whiten(advantages, mask, token_moments(advantages, mask), self.eps)
        return advantages.to(torch.float32)

    def apply(self, batch: RolloutBatch, **scored: Any) -> RolloutBatch:
        """The batch with the critic's ``values`` [N, S] (V at the rollout), A added to
        its advantages, the critic's targets R (``returns``) and the rollout's
        ``critic/explained_variance`` (of V before this step's updates),
        ``critic/returns_mean`` and ``critic/advantages_{mean,std}`` (before whitening)."""
        inputs = self.inputs(batch, **scored)  # refuses a call without the values
        assert inputs.values is not None and inputs.token_rewards is not None
        mask = batch.loss_mask
        values = torch.where(mask > 0, inputs.values.to(torch.float32), 0.0)
        raw = gae(inputs.token_rewards, values, mask, self.gamma, self.lam)  # __call__'s
        raw_mean, raw_std = moments_mean_std(token_moments(raw, mask))
        returns = gae(inputs.token_rewards, values, mask, self.gamma, self.critic_lam)
        returns = torch.where(mask > 0, returns + values.double(), 0.0)
        returns_mean, _ = moments_mean_std(token_moments(returns, mask))
        advantages = self.checked(self._whitened(raw, mask), mask)
        return dataclasses.replace(
            batch, advantages=batch.advantages + advantages, values=values,
            returns=returns.to(torch.float32), metadata={
                **batch.metadata,
                "critic/explained_variance": explained_variance(returns, values, mask),
                "critic/returns_mean": returns_mean,
                "critic/advantages_mean": raw_mean,
                "critic/advantages_std": raw_std})


def with_gae(batch: RolloutBatch, values: torch.Tensor, config: AdvantageConfig
             ) -> RolloutBatch:
    """:meth:`GAE.apply` with ``config``'s settings (the verifier's per-layout batches)."""
    return GAE(config.gamma, config.lam, config.critic_lam, config.normalize,
               config.eps).apply(batch, values=values)

