r"""On-policy distillation (a teacher, rollout/teacher.py): each sampled token y_t of a
response gets its own advantage from the teacher's and the sampling policy's log-probs of
it (both at the sampling temperature), c = ``coef``:

    A_it = c · (log π_teacher(y_t) − log π_old(y_t))   on tokens with m_it > 0

Its expectation over y_t ~ π_old is −c · KL(π_old ‖ π_teacher) at that position: the
policy gradient on it descends the reverse KL, token by token (GKD, arXiv 2306.13649).
Under ``advantage.type: distill`` it is the whole advantage (rewards are logged, not
trained on); with ``rollout.teacher`` beside another type the manager adds it to that
type's. ``distill/reverse_kl`` logs Σ m (log π_old − log π_teacher) / Σ m.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rollout.advantages.base import AdvantageEstimator, AdvantageInputs


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


class Distill(AdvantageEstimator):
    """The module docstring's A_it; the teacher's signal needs no reward spread."""

    needs_teacher: ClassVar[bool] = True
    uses_rewards: ClassVar[bool] = False

    def __init__(self, coef: float = 1.0) -> None:
        self.coef = coef

    def __call__(self, inputs: AdvantageInputs) -> torch.Tensor:
        assert inputs.teacher_log_probs is not None  # declared: AdvantageEstimator.inputs
        return distill_advantages(inputs.teacher_log_probs, inputs.log_probs,
                                  inputs.loss_mask, self.coef)
