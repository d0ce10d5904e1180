"""Custom reducers (``aggregation.custom_reducer: tests.trainer.reducers:<name>``) for
the trainer tests: whole-step weights that no per-sample coefficient can express."""

from __future__ import annotations

import torch

DECAY = 0.8


def discounted_group_mean(loss_mask: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """The t-th valid token of a response weighs DECAY^t; each group's weights are then
    scaled to sum to 1/P (P groups; a group without a valid token gets none), so a
    token's weight depends on its position, its sample and its whole group."""
    mask = loss_mask.to(torch.float64)
    position = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    decayed = mask * DECAY ** position
    groups, dense = torch.unique(group_index, return_inverse=True)
    totals = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, dense,
                                                                     decayed.sum(dim=-1))
    per_sample = torch.where(totals[dense] > 0, 1.0 / (len(groups) * totals[dense]), 0.0)
    return decayed * per_sample[:, None]
