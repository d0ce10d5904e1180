"""One micro-batch as one rank sees it: the samples the step plan gave it, shifted to
next-token positions, then cut to this rank's zigzag CP shard.

Padded: [b, longest] with each sample right-padded. Packed: one row [1, Σ L_i] holding the
samples back to back; every per-token tensor is shifted *within its sample* (a sample's
last token has no target and weight 0: nothing crosses a boundary), each sample is
rounded up to 2·cp and zigzag-sharded on its own (THD context parallelism), and
``sequence_ids`` tells the attention which tokens may see each other: same sample and
true position not after the query's. Shared prefix (``plan.prefix_skip``, CP 1): a
sample that leaves its first k tokens to its head starts at position k in the row and
sees its head's tokens before position k. The row's layout (``trainer/row_layout.py``:
slots, heads, positions, the zigzag view) is built here, once, and checked where used.

Per-token tensors are shifted *before* sharding, so a shard never needs its neighbour's
token to know its target. Weights are built here from the plan's per-sample coefficients,
w_it = m_it · c_i (a custom reducer's dense weights are sliced instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.batch import RolloutBatch
from trainer.context_parallel import (
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from trainer.planted import NOTHING_PLANTED, Planted, PlantedError
from trainer.row_layout import RowLayout, packed_row_index
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
    returns: torch.Tensor | None = None
    """The critic's targets R (PPO with a critic), else None."""
    old_values: torch.Tensor | None = None
    """The critic's values at the rollout, the centre of its value clip, else None."""
    sequence_ids: torch.Tensor | None = None
    """Packed rows: [1, S_local] slot of each token's sample in the row; None: padded."""
    cu_seqlens: torch.Tensor | None = None
    """Packed rows: int32 [n + 1] boundaries of the row's samples, each rounded up to
    2·cp, over the whole (unsharded) row, as THD attention takes them."""
    layout: RowLayout | None = None
    """Packed rows: which slot owns which span, heads and followers of a shared prefix,
    positions, the zigzag view (attention's mask is built from it); None: padded."""

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
    batch: RolloutBatch, plan: StepPlan, samples: list[int], cp_size: int, cp_rank: int
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
    def optional(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else shard(shift_left(x[index, :width]))

    return MicroBatch(
        input_ids=shard(input_ids),
        position_ids=positions.contiguous(),
        targets=shard(shift_left(input_ids)),
        loss_mask=shard(loss_mask),
        advantages=shard(shift_left(batch.advantages[index, :width])),
        rollout_log_probs=shard(shift_left(batch.rollout_log_probs[index, :width])),
        weights={k: shard(w) for k, w in weights.items()},
        old_log_probs=optional(batch.old_log_probs),
        returns=optional(batch.returns),
        old_values=optional(batch.values),
    )


def slice_packed_row(
    batch: RolloutBatch, plan: StepPlan, samples: list[int], cp_size: int, cp_rank: int,
    planted: Planted = NOTHING_PLANTED,
) -> MicroBatch:
    """The packed row of ``samples`` (an empty row: sample 0 with weight 0, so FSDP's
    collectives stay in step), this CP rank's zigzag shard of each sample. ``planted``:
    the rank's planted errors (a test's; ``prefix_mask`` moves the row's layout)."""
    empty = not samples
    index = torch.tensor(samples or [0])
    lengths = batch.sequence_lengths[index]
    skips = None if plan.prefix_skip is None or empty else plan.prefix_skip[index]
    heads = None
    if skips is not None:  # each sample's head as a slot of this row
        slot_of = {int(i): k for k, i in enumerate(index)}
        heads = torch.tensor([slot_of[int(plan.prefix_head[i])] for i in index])
    layout = RowLayout.build(lengths, cp_size, cp_rank, skips, heads,
                             PlantedError.PREFIX_MASK in planted)
    slot, position = layout.slot_T, layout.position_T
    sample, n = index[slot], lengths[slot]
    real, has_target = position < n, position + 1 < n
    width = batch.input_ids.shape[1]
    here = position.clamp(max=width - 1)
    after = (position + 1).clamp(max=width - 1)

    def at(x: torch.Tensor, where: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, x[sample, where], torch.zeros((), dtype=x.dtype))[None]

    loss_mask = at(batch.loss_mask, after, has_target)  # shifted: the target's mask
    if empty:
        loss_mask = torch.zeros_like(loss_mask)
    weights = {term: loss_mask.double() * c[sample][None]
               for term, c in plan.coefficients.items()}
    weights.update({term: at(w, after, has_target) * (0.0 if empty else 1.0)
                    for term, w in plan.dense_weights.items()})
    def optional(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else at(x, after, has_target)

    return MicroBatch(
        layout=layout,
        input_ids=at(batch.input_ids, here, real),
        position_ids=position[None],
        targets=at(batch.input_ids, after, has_target),
        loss_mask=loss_mask,
        advantages=at(batch.advantages, after, has_target),
        rollout_log_probs=at(batch.rollout_log_probs, after, has_target),
        weights=weights,
        old_log_probs=optional(batch.old_log_probs),
        returns=optional(batch.returns),
        old_values=optional(batch.values),
        # a sample's CP padding keeps its slot: it is a key only of its own padding
        sequence_ids=slot[None],
        cu_seqlens=_cu_seqlens(layout),
    )


def _cu_seqlens(layout: RowLayout) -> torch.Tensor:
    """int32 [n + 1] boundaries of the row's slots over the whole (unsharded) row, each
    rounded up to 2·cp (step_plan.row_cu_seqlens' numbers, from the layout)."""
    counts = torch.tensor(layout.local_counts()) * layout.cp_size
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)]).to(
        torch.int32)


def slice_for_plan(batch: RolloutBatch, plan: StepPlan, samples: list[int], cp_size: int,
                   cp_rank: int, planted: Planted = NOTHING_PLANTED) -> MicroBatch:
    """The micro-batch of ``samples`` in the plan's layout (packed row or padded);
    ``planted``: the rank's planted errors (a test's, trainer/planted.py)."""
    if plan.packed:
        return slice_packed_row(batch, plan, samples, cp_size, cp_rank, planted)
    return slice_micro_batch(batch, plan, samples, cp_size, cp_rank)


def gather_log_probs(
    batch: RolloutBatch, samples: list[int], log_probs: torch.Tensor, out: torch.Tensor,
    cp_group: object, cp_size: int, owner: bool, packed: bool = False,
    prefix_skip: torch.Tensor | None = None,
) -> None:
    """Collective over the CP group: put one micro-batch's log-probs (or any per-token
    value: the critic's) (this rank's shard, next-token positions) back into ``out``
    [N, S], aligned with input_ids and 0 where the loss weight is 0 (never scaled by a
    fractional weight). Only an ``owner`` rank writes (one per DP group), so summing ``out``
    over all ranks gives every sample exactly once. ``prefix_skip``: the plan's (shared
    prefix)."""
    import torch.distributed as dist

    shards = [log_probs]
    if cp_size > 1:
        shards = [torch.empty_like(log_probs) for _ in range(cp_size)]
        dist.all_gather(shards, log_probs.contiguous(), group=cp_group)
    if not samples or not owner:
        return
    if packed:  # every rank's shard maps back through its own (slot, position)
        index = torch.tensor(samples)
        lengths = batch.sequence_lengths[index]
        skips = None if prefix_skip is None else prefix_skip[index]
        for rank, shard in enumerate(shards):
            slot, position = packed_row_index(lengths, cp_size, rank, skips)
            keep = position + 1 < lengths[slot]
            rows, cols = index[slot][keep], position[keep] + 1
            out[rows, cols] = torch.where(batch.loss_mask[rows, cols] > 0,
                                          shard[0][keep].float().cpu(), 0.0)
        return
    log_probs = zigzag_unshard(shards, shards[0].shape[1] * cp_size, dim=1)
    index = torch.tensor(samples)
    width = int(batch.sequence_lengths[index].max())
    values = log_probs[:, : width - 1].float().cpu()
    out[index, 1:width] = torch.where(batch.loss_mask[index, 1:width] > 0, values, 0.0)
