r"""Advantages: one scalar per sample from the step's rewards and groups.

Sample i of group g has reward r_i; μ_g and σ_g are the mean and standard deviation
(Bessel-corrected, as in TRL and verl; 0 for a group of one) of the rewards in g, and
ε = ``AdvantageConfig.eps``.

    grpo          A_i = (r_i − μ_g) / (σ_g + ε)        (normalize_std=True, GRPO)
                  A_i =  r_i − μ_g                     (normalize_std=False, Dr. GRPO)
    reinforce_pp  a_i = r_i − μ_g;  A_i = (a_i − mean(a)) / (std(a) + ε)
                  (REINFORCE++ with a group baseline: mean and std over the whole batch)
    reward        A_i = r_i

A group whose rewards are all equal has A_i = 0 under grpo: it carries no signal, which
is why dynamic sampling drops such groups.

On-policy distillation (a teacher, rollout/teacher.py) gives each sampled token y_t of a
response its own advantage from the teacher's and the sampling policy's log-probs of it
(both at the sampling temperature), c = the teacher's ``coef``:

    distill       A_it = c · (log π_teacher(y_t) − log π_old(y_t))   on tokens with m_it > 0

Its expectation over y_t ~ π_old is −c · KL(π_old ‖ π_teacher) at that position: the
policy gradient on it descends the reverse KL, token by token (GKD, arXiv 2306.13649).
With ``rollout.teacher`` beside a task type it is added to the task's per-sample A_i;
under ``advantage.type: distill`` it is the whole advantage. ``distill/reverse_kl`` logs
the estimate Σ m (log π_old − log π_teacher) / Σ m over the rollout's tokens.

PPO with a learned critic (``type: gae``) works per token. For sample i, take its valid
tokens (m_it > 0) in order, k = 1 … K (an environment's observation tokens, m = 0, are
skipped: the time axis is the policy's own tokens); r_k is the reward placed on token k
(the task's reward on the last token, an environment step's reward on the last token of
its action), V_k the critic's value at it, V_{K+1} = 0:

    gae           δ_k = r_k + γ · V_{k+1} − V_k
                  A_k = δ_k + γλ · A_{k+1}                     (A_{K+1} = 0)
                  R_k = A'_k + V_k, A' the same recursion with λ = critic_lam

R_k is the critic's target. VAPO (arXiv 2504.05118) decouples λ: critic_lam = 1 makes R_k
the discounted Monte-Carlo return Σ_{j≥k} γ^{j−k} r_j, unbiased for the critic, while
the policy keeps lam < 1 to lower its variance. With ``normalize`` the advantages are
whitened with the rollout's global statistics over its valid tokens,

    A_k ← (A_k − μ) / (σ + ε),   μ = Σ A / n,   σ² = Σ (A − μ)² / (n − 1)

from the moments (n, Σ A, Σ A²) of every valid token of the rollout — never one rank's or
one mini-batch's (:func:`token_moments` adds up across shards exactly).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rollout.batch import RolloutBatch
from rollout.config import AdvantageConfig


def _group_stats(
    rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample (μ_g, σ_g) of the sample's group."""
    _, dense, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    counts_f = counts.to(rewards.dtype)
    sums = torch.zeros_like(counts_f).index_add_(0, dense, rewards)
    means = sums / counts_f
    squares = torch.zeros_like(counts_f).index_add_(0, dense, (rewards - means[dense]) ** 2)
    # Bessel's correction; a singleton group has no spread (and must not divide by 0).
    stds = torch.where(counts > 1, (squares / (counts_f - 1).clamp(min=1)).sqrt(), 0.0)
    return means[dense], stds[dense]


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (or Dr. GRPO with normalize_std=False) advantages, shape [N]."""
    rewards = rewards.to(torch.float64)  # the sums are exact enough to hand-check
    mean, std = _group_stats(rewards, group_index)
    centered = rewards - mean
    out = centered / (std + eps) if normalize_std else centered
    return out.to(torch.float32)


def reinforce_pp_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ with a group-mean baseline, whitened over the batch, shape [N]."""
    rewards = rewards.to(torch.float64)
    mean, _ = _group_stats(rewards, group_index)
    centered = rewards - mean
    batch_std = centered.std() if centered.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return ((centered - centered.mean()) / (batch_std + eps)).to(torch.float32)


def compute_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, config: AdvantageConfig
) -> torch.Tensor:
    """Advantages [N] of the configured estimator for rewards [N] and group_index [N]
    (types distill and gae: 0, their per-token advantages come on top: the teacher's in
    rollout/manager, GAE where the critic's values are, services/driver/critic.py)."""
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} "
            f"must both have shape [N]"
        )
    if config.type == "grpo":
        return grpo_advantages(rewards, group_index, config.normalize_std, config.eps)
    if config.type == "reinforce_pp":
        return reinforce_pp_advantages(rewards, group_index, config.eps)
    if config.type in ("distill", "gae"):  # per token, added later (teacher, critic)
        return torch.zeros_like(rewards, dtype=torch.float32)
    return rewards.to(torch.float32).clone()


def distill_advantages(teacher_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                       loss_mask: torch.Tensor, coef: float) -> torch.Tensor:
    """A_it = coef · (log π_teacher − log π_old) [N, S] where m_it > 0, else 0 (module
    docstring); every argument [N, S], aligned with the batch's ``input_ids``."""
    gap = teacher_log_probs.to(torch.float64) - old_log_probs.to(torch.float64)
    return torch.where(loss_mask > 0, coef * gap, 0.0).to(torch.float32)


def reverse_kl(teacher_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
               loss_mask: torch.Tensor) -> float:
    """The sampled estimate of KL(π_old ‖ π_teacher) per token: Σ m (log π_old −
    log π_teacher) / Σ m (0 without a weighted token)."""
    weights = loss_mask.to(torch.float64)
    total = float(weights.sum())
    if total == 0:
        return 0.0
    gap = old_log_probs.to(torch.float64) - teacher_log_probs.to(torch.float64)
    return float((weights * gap).sum()) / total


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


def token_moments(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(n, Σ x, Σ x²) float64 over the valid tokens (m > 0): shards' moments add up to
    the whole's exactly, so a rollout split over ranks reduces them by a sum."""
    valid = loss_mask > 0
    x = values.to(torch.float64)[valid]
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(),
                        (x * x).sum()])


def moments_mean_std(moments: torch.Tensor) -> tuple[float, float]:
    """(μ, σ) of (n, Σ x, Σ x²): σ Bessel-corrected, 0 for fewer than two tokens."""
    n, total, squares = (float(v) for v in moments)
    if n == 0:
        return 0.0, 0.0
    mean = total / n
    variance = max(squares - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    return mean, variance ** 0.5


def whiten(advantages: torch.Tensor, loss_mask: torch.Tensor, moments: torch.Tensor,
           eps: float) -> torch.Tensor:
    """(A − μ) / (σ + ε) on the valid tokens, 0 elsewhere, with μ and σ of ``moments``
    (:func:`token_moments` of the whole rollout)."""
    mean, std = moments_mean_std(moments)
    return torch.where(loss_mask > 0, (advantages.to(torch.float64) - mean) / (std + eps),
                       0.0)


def explained_variance(returns: torch.Tensor, values: torch.Tensor,
                       loss_mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over the valid tokens: 1 when the critic predicts every
    return, 0 when it does no better than their mean, negative when worse (0 when the
    returns do not vary)."""
    _, spread = moments_mean_std(token_moments(returns, loss_mask))
    _, error = moments_mean_std(token_moments(returns.double() - values.double(), loss_mask))
    return 1.0 - (error / spread) ** 2 if spread > 0 else 0.0


def with_gae(batch: RolloutBatch, values: torch.Tensor, config: AdvantageConfig
             ) -> RolloutBatch:
    """The batch with the critic's ``values`` [N, S] (V at the rollout), GAE's per-token
    advantages added to its own (a teacher's reverse KL; 0 otherwise), and the critic's
    targets R (``returns``); whitened with the whole rollout's moments when
    ``config.normalize`` (the batch is the whole rollout here). Metadata: the rollout's
    ``critic/explained_variance`` (of V before this step's updates), ``critic/returns_mean``
    and ``critic/advantages_std`` (before whitening)."""
    mask = batch.loss_mask
    values = torch.where(mask > 0, values.to(torch.float32), 0.0)
    rewards = batch.placed_rewards()
    advantages = gae(rewards, values, mask, config.gamma, config.lam)
    returns = gae(rewards, values, mask, config.gamma, config.critic_lam) + values.double()
    returns = torch.where(mask > 0, returns, 0.0)
    moments = token_moments(advantages, mask)
    raw_mean, raw_std = moments_mean_std(moments)
    if config.normalize:
        advantages = whiten(advantages, mask, moments, config.eps)
    returns_mean, _ = moments_mean_std(token_moments(returns, mask))
    return replace(batch, advantages=batch.advantages + advantages.to(torch.float32),
                   values=values, returns=returns.to(torch.float32), metadata={
                       **batch.metadata,
                       "critic/explained_variance": explained_variance(returns, values, mask),
                       "critic/returns_mean": returns_mean,
                       "critic/advantages_mean": raw_mean,
                       "critic/advantages_std": raw_std})
