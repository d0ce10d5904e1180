"""A rollout split into optimizer steps: mini-batches of whole groups, for each epoch.

    num_steps_per_rollout = samples per rollout / global_batch_size
    updates per rollout   = num_steps_per_rollout × ppo_epochs

Each mini-batch is its own aggregation step (its own N, P, M_i, T_g; trainer/step_plan.py
fixes its weights before it is split over ranks). Groups are never split; every epoch
visits the groups in a fresh order drawn from (seed, rollout, epoch), so a resumed run
makes the same updates as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout.batch import RolloutBatch


@dataclass(frozen=True)
class Update:
    """One optimizer step of a rollout."""

    epoch: int
    index: int
    """0-based position among the rollout's updates."""
    sample_indices: list[int]


def rollout_updates(batch: RolloutBatch, samples_per_step: int, num_epochs: int, seed: int,
                    rollout_index: int) -> list[Update]:
    """The rollout's updates in order; one step of one epoch keeps the batch's order."""
    if batch.num_samples % samples_per_step:
        raise ValueError(f"global_batch_size: {batch.num_samples} samples in the rollout are "
                         f"not a multiple of {samples_per_step} per step")
    groups_per_step = samples_per_step // batch.samples_per_prompt
    _, dense = torch.unique(batch.group_index, return_inverse=True)
    members = [torch.nonzero(dense == g).flatten().tolist()
               for g in range(batch.num_prompts)]
    updates = []
    for epoch in range(num_epochs):
        order = np.arange(batch.num_prompts)
        if batch.num_samples > samples_per_step:  # one step: its order does not matter
            order = np.random.default_rng([seed, rollout_index, epoch]).permutation(order)
        for start in range(0, len(order), groups_per_step):
            chosen = order[start:start + groups_per_step]
            updates.append(Update(epoch, len(updates),
                                  [i for g in chosen for i in members[int(g)]]))
    return updates


def mini_batch(batch: RolloutBatch, update: Update) -> RolloutBatch:
    """The update's samples as a batch of their own (the whole batch when it is all)."""
    if update.sample_indices == list(range(batch.num_samples)):
        return batch
    return batch.select(update.sample_indices)
