"""Advantage estimators the tests name by ``class_path``, written as a user would (from
the docs, not from rollout/advantages/grpo.py): Dr. GRPO, and classes that must be refused."""

from __future__ import annotations

from typing import ClassVar

import torch

from rollout.advantages import AdvantageEstimator, AdvantageInputs


class DrGRPO(AdvantageEstimator):
    """A_i = scale · (r_i − mean of r over i's group) on every token of sample i."""

    needs_reward_spread: ClassVar[bool] = True

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        rewards = inputs.rewards.double()
        advantages = torch.empty_like(rewards)
        for group in inputs.group_index.unique():
            members = inputs.group_index == group
            advantages[members] = rewards[members] - rewards[members].mean()
        return (self.scale * advantages).float()[:, None] * (inputs.loss_mask > 0)


class NotAnEstimator:
    """Callable like an estimator, but not an AdvantageEstimator subclass."""

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        return torch.zeros_like(inputs.loss_mask)


def not_a_class(inputs: AdvantageInputs) -> torch.Tensor:
    return torch.zeros_like(inputs.loss_mask)


class WrongShape(AdvantageEstimator):
    """Returns one advantage per sample, not per token."""

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        return inputs.rewards.clone()


class NeedsTeacher(AdvantageEstimator):
    """Declares it reads a teacher's log-probs."""

    needs_teacher: ClassVar[bool] = True

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        assert inputs.teacher_log_probs is not None
        return inputs.teacher_log_probs - inputs.log_probs
