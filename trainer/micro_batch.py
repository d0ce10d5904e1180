"""One micro-batch as one rank sees it: the samples the step plan gave it, shifted to
next-token positions, then cut to this rank's zigzag CP shard.

Per-token tensors are shifted *before* sharding, so a shard never needs its neighbour's
token to know its target. Weights are built here from the plan's per-sample coefficients,
w_it = m_it · c_i (a custom reducer's dense weights are sliced instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.batch import TrainBatch
from trainer.context_parallel import zigzag_positions, zigzag_shard, zigzag_unshard
from trainer.step_plan import StepPlan


@dataclass
class MicroBatch:
    """[b, S_local] tensors on next-token positions; weights float64 per term."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_log_probs: torch.Tensor
    weights: dict[str, torch.Tensor]
    old_log_probs: torch.Tensor | None = None
    """The trainer's start-of-rollout log-probs (several updates per rollout), else None."""

    def to(self, device: torch.device) -> MicroBatch:
        def move(value: object) -> object:
            if isinstance(value, dict):
                return {k: v.to(device) for k, v in value.items()}
            return value.to(device) if isinstance(value, torch.Tensor) else value

        return MicroBatch(**{name: move(value) for name, value in vars(self).items()})


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """Value at position t becomes the target of position t−1 (last position gets 0)."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def slice_micro_batch(
    batch: TrainBatch, plan: StepPlan, samples: list[int], cp_size: int, cp_rank: int
) -> MicroBatch:
    """The micro-batch of ``samples`` (an empty list keeps FSDP's collectives in step:
    one sample with weight 0)."""
    empty = not samples
    index = torch.tensor(samples or [0])
    width = int(batch.sequence_lengths[index].max())
    input_ids = batch.input_ids[index, :width]
    loss_mask = shift_left(batch.loss_mask[index, :width])
    if empty:
        loss_mask = torch.zeros_like(loss_mask)
    weights = {term: loss_mask.double() * c[index, None]
               for term, c in plan.coefficients.items()}
    weights.update({term: shift_left(w[index, :width]) * (0.0 if empty else 1.0)
                    for term, w in plan.dense_weights.items()})

    def shard(x: torch.Tensor) -> torch.Tensor:
        return zigzag_shard(x, cp_size, cp_rank, dim=1)

    positions = zigzag_positions(width, cp_size, cp_rank)[None, :].expand(len(index), -1)
    old = batch.old_log_probs
    return MicroBatch(
        input_ids=shard(input_ids),
        position_ids=positions.contiguous(),
        targets=shard(shift_left(input_ids)),
        loss_mask=shard(loss_mask),
        advantages=batch.advantages[index, None].expand(-1, positions.shape[1]).contiguous(),
        rollout_log_probs=shard(shift_left(batch.rollout_log_probs[index, :width])),
        weights={k: shard(w) for k, w in weights.items()},
        old_log_probs=None if old is None else shard(shift_left(old[index, :width])),
    )


def gather_log_probs(
    batch: TrainBatch, samples: list[int], log_probs: torch.Tensor, out: torch.Tensor,
    cp_group: object, cp_size: int, owner: bool,
) -> None:
    """Collective over the CP group: put one micro-batch's log-probs (this rank's shard,
    next-token positions) back into ``out`` [N, S], aligned with input_ids and 0 outside
    the loss mask. Only an ``owner`` rank writes (one per DP group), so summing ``out``
    over all ranks gives every sample exactly once."""
    import torch.distributed as dist

    if cp_size > 1:
        shards = [torch.empty_like(log_probs) for _ in range(cp_size)]
        dist.all_gather(shards, log_probs.contiguous(), group=cp_group)
        log_probs = zigzag_unshard(shards, shards[0].shape[1] * cp_size, dim=1)
    if not samples or not owner:
        return
    index = torch.tensor(samples)
    width = int(batch.sequence_lengths[index].max())
    values = log_probs[:, : width - 1].float().cpu()
    out[index, 1:width] = values * batch.loss_mask[index, 1:width]
