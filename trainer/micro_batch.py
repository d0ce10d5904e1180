"""One micro-batch as one rank sees it: the samples the step plan gave it, shifted to
next-token positions, then cut to this rank's zigzag CP shard.

Padded: [b, longest] with each sample right-padded. Packed: one row [1, Σ L_i] holding the
samples back to back; every per-token tensor is shifted *within its sample* (a sample's
last token has no target and weight 0: nothing crosses a boundary), each sample is
rounded up to 2·cp and zigzag-sharded on its own (THD context parallelism), and
``sequence_ids`` tells the attention which tokens may see each other: same sample and
true position not after the query's.

Per-token tensors are shifted *before* sharding, so a shard never needs its neighbour's
token to know its target. Weights are built here from the plan's per-sample coefficients,
w_it = m_it · c_i (a custom reducer's dense weights are sliced instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.batch import TrainBatch
from trainer.context_parallel import (
    padded_length,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
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
    sequence_ids: torch.Tensor | None = None
    """Packed rows: [1, S_local] slot of each token's sample in the row; None: padded."""

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


def slice_packed_row(
    batch: TrainBatch, plan: StepPlan, samples: list[int], cp_size: int, cp_rank: int
) -> MicroBatch:
    """The packed row of ``samples`` (an empty row: sample 0 with weight 0, so FSDP's
    collectives stay in step), this CP rank's zigzag shard of each sample."""
    empty = not samples

    def pack(per_sample: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([zigzag_shard(x, cp_size, cp_rank, dim=-1) for x in per_sample],
                         dim=-1)[None]

    ids, positions, slots, masks, adv, rollout, old = [], [], [], [], [], [], []
    weights: dict[str, list[torch.Tensor]] = {t: [] for t in (*plan.coefficients,
                                                               *plan.dense_weights)}
    for slot, i in enumerate(samples or [0]):
        n = int(batch.sequence_lengths[i])
        tokens = batch.input_ids[i:i + 1, :n]
        mask = shift_left(batch.loss_mask[i:i + 1, :n])[0] * (0.0 if empty else 1.0)
        ids.append(torch.stack([tokens[0], shift_left(tokens)[0]]))
        positions.append(zigzag_positions(n, cp_size, cp_rank))
        slots.append(torch.full((n,), slot))
        masks.append(mask)
        adv.append(batch.advantages[i].expand(n))
        rollout.append(shift_left(batch.rollout_log_probs[i:i + 1, :n])[0])
        if batch.old_log_probs is not None:
            old.append(shift_left(batch.old_log_probs[i:i + 1, :n])[0])
        for term, c in plan.coefficients.items():
            weights[term].append(mask.double() * c[i])
        for term, w in plan.dense_weights.items():
            weights[term].append(shift_left(w[i:i + 1, :n])[0] * (0.0 if empty else 1.0))
    tokens_and_targets = pack(ids)  # [1, 2, S_local]
    # a sample's CP padding takes its own slot, so it is a key only of its own padding
    return MicroBatch(
        input_ids=tokens_and_targets[:, 0],
        position_ids=torch.cat(positions)[None],
        targets=tokens_and_targets[:, 1],
        loss_mask=pack(masks),
        advantages=pack(adv),
        rollout_log_probs=pack(rollout),
        weights={term: pack(w) for term, w in weights.items()},
        old_log_probs=pack(old) if old else None,
        sequence_ids=torch.cat([zigzag_shard(s, cp_size, cp_rank, pad_value=slot)
                                for slot, s in enumerate(slots)])[None],
    )


def slice_for_plan(batch: TrainBatch, plan: StepPlan, samples: list[int], cp_size: int,
                   cp_rank: int) -> MicroBatch:
    """The micro-batch of ``samples`` in the plan's layout (packed row or padded)."""
    slicer = slice_packed_row if plan.packed else slice_micro_batch
    return slicer(batch, plan, samples, cp_size, cp_rank)


def gather_log_probs(
    batch: TrainBatch, samples: list[int], log_probs: torch.Tensor, out: torch.Tensor,
    cp_group: object, cp_size: int, owner: bool, packed: bool = False,
) -> None:
    """Collective over the CP group: put one micro-batch's log-probs (this rank's shard,
    next-token positions) back into ``out`` [N, S], aligned with input_ids and 0 outside
    the loss mask. Only an ``owner`` rank writes (one per DP group), so summing ``out``
    over all ranks gives every sample exactly once."""
    import torch.distributed as dist

    shards = [log_probs]
    if cp_size > 1:
        shards = [torch.empty_like(log_probs) for _ in range(cp_size)]
        dist.all_gather(shards, log_probs.contiguous(), group=cp_group)
    if not samples or not owner:
        return
    if packed:
        offset = 0
        for i in samples:  # each sample's shard sits at the same offset on every rank
            n = int(batch.sequence_lengths[i])
            local = padded_length(n, cp_size) // cp_size
            values = zigzag_unshard([s[0, offset:offset + local] for s in shards], n)
            offset += local
            out[i, 1:n] = values[: n - 1].float().cpu() * batch.loss_mask[i, 1:n]
        return
    log_probs = zigzag_unshard(shards, shards[0].shape[1] * cp_size, dim=1)
    index = torch.tensor(samples)
    width = int(batch.sequence_lengths[index].max())
    values = log_probs[:, : width - 1].float().cpu()
    out[index, 1:width] = values * batch.loss_mask[index, 1:width]
