r"""The reward itself, no baseline (REINFORCE):

    A_i = r_i   on every token of sample i
"""

from __future__ import annotations

import torch

from rollout.advantages.base import AdvantageEstimator, AdvantageInputs, per_token


class Reward(AdvantageEstimator):
    """A_i = r_i: a group without reward spread still has a gradient."""

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        return per_token(inputs.rewards, inputs.loss_mask)
