r"""The KL to the reference in the reward (``trainer.loss.kl_placement: reward``): the
per-token penalty, what each estimator's rewards become, and β's controller.

For sample i and its valid tokens (m_it > 0; 0 elsewhere), π_old the policy at the
rollout (the trainer's log-probs before the update, or the engine's with
``old_log_probs: rollout``) and π_ref the frozen reference:

    k1_it = log π_old(a_it) − log π_ref(a_it)
    r'_it = r_it − β · k1_it              token rewards (GAE, a custom estimator's)
    r'_i  = r_i  − β · Σ_t k1_it          the sample's reward (grpo, reinforce_pp, reward)

The second line is verl's ``apply_kl_penalty`` (TRL's PPO, OpenRLHF): the penalty is in
the rewards before advantages, so GAE's returns and the critic see it; the third is what
an estimator without token rewards sees (verl sums the token-level scores). β is fixed
(``kl_coef``) or Ziegler et al.'s (2019) adaptive controller, moved after each rollout
step by its mean KL per sample e over its n samples:

    e = (1/n) Σ_i Σ_t k1_it
    β ← β · (1 + clip((e − target) / target, −0.2, 0.2) · n / horizon)

β rises when the policy drifts past ``target`` and falls when it stays closer; the
step's rewards use the β from before its own update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

CLIP = 0.2
"""Ziegler et al.'s bound on the proportional error of one update."""


def kl_per_token(old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                 loss_mask: torch.Tensor) -> torch.Tensor:
    """k1 [N, S] float64 of the module docstring on valid tokens, 0 elsewhere."""
    k1 = old_log_probs.to(torch.float64) - ref_log_probs.to(torch.float64)
    return torch.where(loss_mask > 0, k1, 0.0)


def penalized_token_rewards(token_rewards: torch.Tensor, penalty: torch.Tensor
                            ) -> torch.Tensor:
    """r'_it = r_it − β·k1_it [N, S] float64 (``penalty``: β times :func:`kl_per_token`)."""
    return token_rewards.to(torch.float64) - penalty


def penalized_rewards(rewards: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """r'_i = r_i − β·Σ_t k1_it [N], in ``rewards``' dtype."""
    return (rewards.to(torch.float64) - penalty.sum(dim=-1)).to(rewards.dtype)


@dataclass
class KLController:
    """β and its rule (module docstring): fixed, or adaptive toward ``target`` nats per
    sample over ``horizon`` samples. Its state is β alone (:meth:`state_dict`)."""

    beta: float
    adaptive: bool = False
    target: float = 6.0
    horizon: int = 10000

    def update(self, mean_kl: float, num_samples: int) -> float:
        """β after a step whose samples' mean Σ_t k1 is ``mean_kl`` (e) over
        ``num_samples`` (n); unchanged when fixed. Returns the new β."""
        if self.adaptive:
            error = min(max((mean_kl - self.target) / self.target, -CLIP), CLIP)
            self.beta *= 1.0 + error * num_samples / self.horizon
        return self.beta

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        beta = state["beta"]
        if not isinstance(beta, int | float) or not beta > 0:
            raise ValueError(f"kl controller state: beta must be a number > 0, got {beta!r}")
        self.beta = float(beta)
