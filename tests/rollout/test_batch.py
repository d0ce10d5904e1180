"""The RolloutBatch schema: advantages are per token ([N, S]; a per-sample one is a row
of equal values over its response), loss weights m_it lie in [0, 1] and M_i, T_g are
their sums, and what breaks the schema is named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout.batch import RolloutBatch, RolloutBatchError

PROMPTS = [[1, 2], [1, 2], [3], [3]]
RESPONSES = [[4, 5], [6], [7, 8, 9], [2]]
LOG_PROBS = [[-0.5, -1.25], [-2.0], [-0.1, -0.2, -0.3], [-4.0]]


def batch(advantages: list, masks: list | None = None) -> RolloutBatch:
    return RolloutBatch.from_samples(PROMPTS, RESPONSES, LOG_PROBS, [1.0, 0.0, 0.5, 0.25],
                                     advantages, [0, 0, 1, 1], 2, response_masks=masks)


def test_a_per_sample_advantage_is_a_row_of_equal_values_over_its_response() -> None:
    per_sample = batch([0.5, -0.5, 0.125, -0.125])
    per_token = batch([[0.5, 0.5], [-0.5], [0.125] * 3, [-0.125]])
    assert per_sample.advantages.shape == (4, 4)
    assert torch.equal(per_sample.advantages, per_token.advantages)
    assert per_sample.advantages[2].tolist() == [0.0, 0.125, 0.125, 0.125]
    # a batch built from tensors (a checkpoint written before advantages were per token)
    old = RolloutBatch(**{f: getattr(per_sample, f) for f in (
        "input_ids", "prompt_lengths", "response_lengths", "loss_mask", "rollout_log_probs",
        "rewards", "group_index")}, advantages=torch.tensor([0.5, -0.5, 0.125, -0.125]),
        samples_per_prompt=2)
    assert torch.equal(old.advantages, per_sample.advantages)


def test_fractional_weights_sum_to_m_i_and_t_g() -> None:
    b = batch([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0], [7.0]], [[1, 0.5], [0.25], [1, 0, 0.5], [0]])
    assert b.sample_token_counts.tolist() == [1.5, 0.25, 1.5, 0.0]
    assert b.prompt_mask_sums.tolist() == [1.75, 1.5]
    assert b.num_valid_tokens == 5  # tokens with m > 0
    assert b.advantages[2].tolist() == [0.0, 4.0, 5.0, 6.0]
    picked = b.select([2, 3])
    assert picked.advantages.tolist() == b.advantages[[2, 3]].tolist()
    assert picked.sample_token_counts.tolist() == [1.5, 0.0]


def test_what_breaks_the_schema_is_named() -> None:
    with pytest.raises(RolloutBatchError, match="advantages: sample 1 has 2 advantage"):
        batch([[1.0, 2.0], [3.0, 4.0], [4.0, 5.0, 6.0], [7.0]])
    with pytest.raises(RolloutBatchError, match="advantages: sample 1 has one advantage"):
        batch([[1.0, 2.0], 3.0, [4.0, 5.0, 6.0], [7.0]])
    with pytest.raises(RolloutBatchError, match=r"loss_mask: a token's weight m_it must lie"):
        batch([0.0] * 4, [[1, 1.5], [1], [1, 1, 1], [1]])
    good = batch([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0], [7.0]])
    outside = good.advantages.clone()
    outside[0, 0] = 1.0  # a prompt token
    with pytest.raises(RolloutBatchError, match="advantages: is non-zero outside the resp"):
        RolloutBatch(**{**{f: getattr(good, f) for f in (
            "input_ids", "prompt_lengths", "response_lengths", "loss_mask",
            "rollout_log_probs", "rewards", "group_index")}, "advantages": outside,
            "samples_per_prompt": 2})
    inf = [[1.0, float("inf")], [3.0], [4.0, 5.0, 6.0], [7.0]]
    with pytest.raises(RolloutBatchError, match="advantages: contains NaN or inf"):
        batch(inf)


def test_rewards_are_placed_on_tokens_per_turn_or_on_the_last_valid_token() -> None:
    """An episode's step rewards sit on the last token of each action (``turn_rewards``)
    and sum to its reward, which GRPO keeps using; without them a sample's reward sits on
    its last valid token (a trailing observation, mask 0, is not one)."""
    masks = [[1, 1, 0, 0, 1, 1, 0], [1, 1, 1]]
    batch = RolloutBatch.from_samples(
        prompt_ids=[[5, 6], [5, 6]], response_ids=[[7] * 7, [8] * 3],
        response_log_probs=[[-0.5] * 7, [-0.5] * 3], rewards=[1.5, 2.0],
        advantages=[0.0, 0.0], group_index=[0, 0], samples_per_prompt=2,
        response_masks=masks, turn_rewards=[[(1, 0.5), (5, 1.0)], [(2, 2.0)]])
    placed = batch.placed_rewards()
    assert placed[0].tolist() == [0, 0, 0, 0.5, 0, 0, 0, 1.0, 0]
    assert placed.sum(-1).tolist() == batch.rewards.double().tolist()
    plain = dataclasses.replace(batch, token_rewards=None).placed_rewards()
    assert plain[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 1.5, 0]  # its last valid token
    assert plain[1].tolist() == [0, 0, 0, 0, 2.0, 0, 0, 0, 0]
    with pytest.raises(RolloutBatchError, match="turn_rewards: sample 1"):
        RolloutBatch.from_samples([[5], [5]], [[7], [8]], [[-0.5], [-0.5]], [1.0, 1.0],
                                  [0.0, 0.0], [0, 0], 2, turn_rewards=[[], [(1, 1.0)]])
