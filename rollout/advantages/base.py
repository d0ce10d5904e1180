"""The contract every advantage estimator keeps, built-in or a user's own.

An estimator is constructed with its config's settings (a user's: ``advantage.kwargs``)
and called with :class:`AdvantageInputs` of one whole rollout; it returns A [N, S], the
advantage of each token, aligned with the batch's ``input_ids`` (entries where
``loss_mask`` is 0 are ignored and stored as 0). What it reads beyond rewards, groups and
the mask it declares as class attributes, and the manager and driver hand it exactly
that: they ask the estimator, never its name.

    needs_critic         .values: the critic's V [N, S] (the driver calls it then)
    needs_teacher        .teacher_log_probs [N, S] (the manager's teacher scores first)
    needs_token_rewards  .token_rewards [N, S]: each turn's reward on its last token
    needs_reward_spread  a group whose rewards are all equal gets advantage 0
    needs_truncation     .truncated [N] bool: responses cut at the length limit (the
                         batch's; an instance may set it from its settings: GAE's
                         ``bootstrap_truncated``)
    uses_rewards         False: rewards are logged, but do not train (distillation)

With the KL in the reward (``trainer.loss.kl_placement: reward``, rollout/kl_reward.py)
the driver hands :meth:`AdvantageEstimator.apply` ``kl_penalty`` [N, S] = β·k1 per token,
and every estimator's rewards arrive penalised: ``.token_rewards`` r_it − β·k1_it,
``.rewards`` r_i − β·Σ_t k1_it (``.kl_penalty`` itself too, for a user's own use).

An **unscored** sample (``.scored`` False: a reward part could not score it, the batch's
``scored``) has no reward, not a zero one: every estimator that uses rewards leaves it out
of its statistics (a group's baseline and spread: :func:`group_stats` over the scored
members; a batch's whitening) and :meth:`AdvantageEstimator.apply` sets its advantage to
0 whatever the estimator returned (a user's own included). A group none of whose samples
was scored has advantage 0 throughout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from rollout.kl_reward import penalized_rewards, penalized_token_rewards

if TYPE_CHECKING:
    from rollout.batch import RolloutBatch


@dataclass(frozen=True)
class AdvantageInputs:
    """One rollout as an estimator sees it; the optional fields are None unless the
    estimator declared it needs them."""

    rewards: torch.Tensor
    """[N] float32: each sample's reward (less β·Σ_t k1 with the KL in the reward)."""
    group_index: torch.Tensor
    """[N] int64: samples of one prompt share it."""
    loss_mask: torch.Tensor
    """[N, S] float32: m_it > 0 on the policy's own response tokens."""
    log_probs: torch.Tensor
    """[N, S] float32: the sampling policy's log π_old of each response token."""
    values: torch.Tensor | None = None
    """[N, S]: the critic's V at each response token (``needs_critic``)."""
    teacher_log_probs: torch.Tensor | None = None
    """[N, S]: the teacher's log-prob of each sampled token (``needs_teacher``)."""
    token_rewards: torch.Tensor | None = None
    """[N, S] float64: rewards placed on tokens (``needs_token_rewards``), less β·k1."""
    kl_penalty: torch.Tensor | None = None
    """[N, S] float64: β·k1 of each token with the KL in the reward (already taken off
    ``rewards`` and ``token_rewards``); None otherwise."""
    truncated: torch.Tensor | None = None
    """[N] bool: the responses cut at the length limit (``needs_truncation``)."""
    scored: torch.Tensor | None = None
    """[N] bool: every reward part scored the sample (module docstring); None: all were."""


class AdvantageEstimator:
    """Subclass it, declare what you need, implement ``__call__`` (docs/extending.md)."""

    needs_critic: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = False
    needs_token_rewards: ClassVar[bool] = False
    needs_reward_spread: ClassVar[bool] = False
    uses_rewards: ClassVar[bool] = True
    needs_truncation: bool = False
    """Not a ClassVar: whether an estimator reads the cut flags may be a setting."""

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        """A [N, S] of ``inputs`` (module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement __call__")

    def inputs(self, batch: RolloutBatch, values: torch.Tensor | None = None,
               teacher_log_probs: torch.Tensor | None = None,
               kl_penalty: torch.Tensor | None = None) -> AdvantageInputs:
        """What this estimator declared it reads, from ``batch`` and what was scored;
        ``kl_penalty`` (β·k1 [N, S]) is taken off the rewards it reads."""
        for name, needed, given in (("values", self.needs_critic, values),
                                    ("teacher_log_probs", self.needs_teacher,
                                     teacher_log_probs)):
            if needed and given is None:
                raise ValueError(f"{type(self).__name__} needs {name}; none were given")
        rewards = batch.rewards
        token_rewards = batch.placed_rewards() if self.needs_token_rewards else None
        if kl_penalty is not None:
            kl_penalty = torch.where(batch.loss_mask > 0, kl_penalty.to(torch.float64), 0.0)
            rewards = penalized_rewards(rewards, kl_penalty)
            if token_rewards is not None:
                token_rewards = penalized_token_rewards(token_rewards, kl_penalty)
        return AdvantageInputs(
            rewards=rewards, group_index=batch.group_index, loss_mask=batch.loss_mask,
            log_probs=batch.rollout_log_probs,
            values=values if self.needs_critic else None,
            teacher_log_probs=teacher_log_probs if self.needs_teacher else None,
            token_rewards=token_rewards, kl_penalty=kl_penalty,
            truncated=batch.truncated if self.needs_truncation else None,
            scored=batch.scored)

    def trained_mask(self, loss_mask: torch.Tensor, scored: torch.Tensor | None
                     ) -> torch.Tensor:
        """``loss_mask`` where this estimator's advantages may be non-zero: an unscored
        sample's row is 0 when the estimator uses rewards (a teacher's term does not)."""
        return scored_mask(loss_mask, scored) if self.uses_rewards else loss_mask

    def apply(self, batch: RolloutBatch, **scored: Any) -> RolloutBatch:
        """``batch`` with this estimator's A added to its advantages (a rollout.teacher's
        term may already be there), 0 for an unscored sample; ``scored``: values,
        teacher_log_probs, kl_penalty."""
        advantages = self.checked(self(self.inputs(batch, **scored)),
                                  self.trained_mask(batch.loss_mask, batch.scored))
        return dataclasses.replace(batch, advantages=batch.advantages + advantages)

    def checked(self, advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """``advantages`` as float32 [N, S], 0 where the mask is; a wrong shape or a NaN
        is refused naming the estimator (a user's class may return either)."""
        name = type(self).__name__
        if not isinstance(advantages, torch.Tensor) or advantages.shape != loss_mask.shape:
            got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else \
                type(advantages).__name__
            raise ValueError(f"{name} returned {got}, not advantages of shape "
                             f"{tuple(loss_mask.shape)} (one per token of input_ids)")
        kept = torch.where(loss_mask > 0, advantages.to(torch.float32), 0.0)
        if not torch.isfinite(kept).all():
            raise ValueError(f"{name} returned a NaN or infinite advantage")
        return kept


def per_token(advantages_N: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """A per-sample advantage [N] as a row of equal values over each sample's tokens."""
    return torch.where(loss_mask > 0, advantages_N.to(torch.float32)[:, None], 0.0)


def scored_mask(loss_mask: torch.Tensor, scored: torch.Tensor | None) -> torch.Tensor:
    """``loss_mask`` [N, S] with the rows of unscored samples 0 (``scored`` [N] bool; None:
    every sample scored)."""
    if scored is None:
        return loss_mask
    return torch.where(scored.bool()[:, None], loss_mask, torch.zeros_like(loss_mask))


def group_stats(rewards: torch.Tensor, group_index: torch.Tensor,
                scored: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample (μ_g, σ_g) of the sample's group over its scored members S_g (all of
    them when ``scored`` is None): n_g = |S_g|, μ_g = Σ_{j∈S_g} r_j / n_g,
    σ_g² = Σ_{j∈S_g} (r_j − μ_g)² / (n_g − 1), Bessel-corrected (TRL, verl); 0 when
    n_g is 0 (μ) or ≤ 1 (σ). An unscored sample's own reward never enters."""
    _, dense, _ = torch.unique(group_index, return_inverse=True, return_counts=True)
    weight = (torch.ones_like(rewards) if scored is None
              else scored.bool().to(rewards.dtype))
    rewards = torch.where(weight > 0, rewards, 0.0)  # an unscored one, any value, adds 0
    num_groups = int(dense.max()) + 1 if dense.numel() else 0
    counts_f = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, dense, weight)
    sums = torch.zeros_like(counts_f).index_add_(0, dense, rewards)
    means = sums / counts_f.clamp(min=1)
    squares = torch.zeros_like(counts_f).index_add_(
        0, dense, weight * (rewards - means[dense]) ** 2)
    # Bessel's correction; a group of one scored sample has no spread (and must not
    # divide by 0).
    stds = torch.where(counts_f > 1, (squares / (counts_f - 1).clamp(min=1)).sqrt(), 0.0)
    return means[dense], stds[dense]
