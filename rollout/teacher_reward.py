r"""A teacher's reverse KL in the token rewards (``rollout.teacher.placement: reward``),
so GAE's returns and the critic credit it, as the KL to the reference in the reward
(rollout/kl_reward.py) is.

For sample i and its valid tokens (m_it > 0; nothing changes elsewhere), r_it the reward
placed on token t (the task's on the last valid token, an environment step's on the last
token of its action: ``RolloutBatch.placed_rewards``), π_old the sampling policy (the
engine's log-probs), π_teacher the teacher's of the same sampled token, c = ``coef``:

    r'_it = r_it − c · (log π_old(y_t) − log π_teacher(y_t))
          = r_it + d_it,   d_it = c · (log π_teacher(y_t) − log π_old(y_t))

d_it is exactly the per-token advantage of ``placement: advantage``
(rollout/advantages/distill.py ``distill_advantages``): its expectation over
y_t ~ π_old is −c · KL(π_old ‖ π_teacher) at that position. There it is added to the
advantages after the estimator, so a critic never sees it; here GAE discounts it back
through the response like any reward and the critic's targets hold it. The sample's
reward ``rewards`` [N] stays the task's (logged as such; ``distill/reverse_kl`` logs the
teacher's term).
"""

from __future__ import annotations

import dataclasses

import torch

from rollout.advantages.distill import distill_advantages
from rollout.batch import RolloutBatch


def teacher_token_rewards(batch: RolloutBatch, teacher_log_probs: torch.Tensor,
                          coef: float) -> torch.Tensor:
    """r'_it [N, S] float64 of the module docstring: the batch's placed rewards plus
    d_it on its valid tokens (``teacher_log_probs`` [N, S], aligned with ``input_ids``)."""
    term = distill_advantages(teacher_log_probs, batch.rollout_log_probs, batch.loss_mask,
                              coef)
    return batch.placed_rewards() + term.to(torch.float64)


def with_teacher_in_rewards(batch: RolloutBatch, teacher_log_probs: torch.Tensor,
                            coef: float) -> RolloutBatch:
    """``batch`` with :func:`teacher_token_rewards` as its ``token_rewards`` (float32,
    the schema's), which an estimator that ``needs_token_rewards`` reads (GAE)."""
    rewards = teacher_token_rewards(batch, teacher_log_probs, coef)
    return dataclasses.replace(batch, token_rewards=rewards.to(torch.float32))
