"""A rollout split into optimizer steps of whole groups, per epoch."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.helpers import random_train_batch
from trainer.mini_batches import mini_batch, rollout_updates


def _groups(batch, indices: list[int]) -> list[int]:
    return batch.group_index[indices].tolist()


def test_steps_hold_whole_groups_and_each_epoch_covers_the_rollout_once() -> None:
    batch = random_train_batch(vocab_size=50, num_prompts=8, group_size=2)
    updates = rollout_updates(batch, samples_per_step=4, num_epochs=2, seed=0,
                              rollout_index=5)
    assert [(u.epoch, u.index) for u in updates] == [(e, i) for i, e in
                                                     enumerate([0] * 4 + [1] * 4)]
    for epoch in (0, 1):
        seen = sorted(i for u in updates if u.epoch == epoch for i in u.sample_indices)
        assert seen == list(range(batch.num_samples))
    for update in updates:
        groups = _groups(batch, update.sample_indices)
        assert len(update.sample_indices) == 4
        assert all(groups.count(g) == batch.samples_per_prompt for g in groups)
    first, second = ([u.sample_indices for u in updates if u.epoch == e] for e in (0, 1))
    assert first != second  # each epoch reshuffles the groups


def test_the_order_is_seeded_by_seed_rollout_and_epoch() -> None:
    batch = random_train_batch(vocab_size=50, num_prompts=8, group_size=2)

    def order(seed: int, rollout: int) -> list[list[int]]:
        return [u.sample_indices for u in rollout_updates(batch, 4, 2, seed, rollout)]

    assert order(0, 3) == order(0, 3)  # a resumed run makes the same updates
    assert order(0, 3) != order(0, 4)
    assert order(0, 3) != order(1, 3)


def test_one_step_per_epoch_keeps_the_batch() -> None:
    batch = random_train_batch(vocab_size=50, num_prompts=3, group_size=2)
    updates = rollout_updates(batch, samples_per_step=6, num_epochs=2, seed=0,
                              rollout_index=0)
    assert [u.sample_indices for u in updates] == [list(range(6))] * 2
    assert mini_batch(batch, updates[0]) is batch


def test_mini_batch_is_its_own_aggregation_step() -> None:
    batch = random_train_batch(vocab_size=50, num_prompts=4, group_size=2)
    update = rollout_updates(batch, 4, 1, seed=0, rollout_index=0)[1]
    mini = mini_batch(batch.with_old_log_probs(batch.rollout_log_probs * 2), update)
    assert mini.num_samples == 4 and mini.num_prompts == 2
    assert torch.equal(mini.sample_token_counts,
                       batch.sample_token_counts[update.sample_indices])
    assert torch.equal(mini.old_log_probs, batch.rollout_log_probs[update.sample_indices] * 2)


def test_a_rollout_that_does_not_split_into_whole_steps_is_refused() -> None:
    batch = random_train_batch(vocab_size=50, num_prompts=3, group_size=2)
    with pytest.raises(ValueError, match="global_batch_size: 6 samples"):
        rollout_updates(batch, samples_per_step=4, num_epochs=1, seed=0, rollout_index=0)
