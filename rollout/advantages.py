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
"""

from __future__ import annotations

import torch

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
    (type distill: 0, the teacher's per-token advantage comes on top, rollout/manager)."""
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} "
            f"must both have shape [N]"
        )
    if config.type == "grpo":
        return grpo_advantages(rewards, group_index, config.normalize_std, config.eps)
    if config.type == "reinforce_pp":
        return reinforce_pp_advantages(rewards, group_index, config.eps)
    if config.type == "distill":  # the teacher's per-token advantage is all of it
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
