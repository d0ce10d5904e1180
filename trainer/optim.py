"""Optimizer and learning-rate schedule.

    lr(s) = lr · s / warmup                                   for s < warmup
    lr(s) = lr                                                constant
    lr(s) = lr · (m + (1 − m) · ½(1 + cos(π · progress)))     cosine, m = min_lr_ratio

s counts the optimizer steps of the schedule's own role: the scheduler moves with its
optimizer's steps only, so PPO's policy, which sits out the critic's warm-up, starts its
warm-up at its first step, and its horizon (``total_steps``) is the steps it takes:
:func:`schedule_steps`.
"""

from __future__ import annotations

import math

import torch

from trainer.config import OptimizerConfig


def build_optimizer(
    params: list[torch.nn.Parameter], config: OptimizerConfig
) -> torch.optim.Optimizer:
    if config.type == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    return torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )


def lr_factor(step: int, config: OptimizerConfig, total_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


def schedule_steps(num_rollouts: int, updates_per_rollout: int,
                   rollouts_sat_out: int = 0) -> int:
    """The optimizer steps a role's schedule spans: ``updates_per_rollout`` for each
    rollout it trains on, the first ``rollouts_sat_out`` excepted (the policy: the
    critic's ``warmup_steps``; a critic steps on every rollout). At least 1."""
    return max(1, (num_rollouts - min(rollouts_sat_out, num_rollouts)) * updates_per_rollout)


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config, total_steps)
    )
