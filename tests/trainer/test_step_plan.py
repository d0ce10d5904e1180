from __future__ import annotations

import pytest
import torch

from tests.trainer.helpers import random_train_batch
from trainer.aggregation import token_weights
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.micro_batch import slice_micro_batch
from trainer.step_plan import assign_micro_batches, padding_fraction, plan_step

LENGTHS = [9, 3, 14, 5, 5, 7, 2, 11, 6, 4]


@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("budget", [8, 20, 64])
def test_every_sample_once_within_budget_and_equal_counts(dp_size: int, budget: int) -> None:
    plans = assign_micro_batches(LENGTHS, dp_size, budget)
    assert len(plans) == dp_size
    assert len({len(p) for p in plans}) == 1  # FSDP needs the same number of forwards
    seen = sorted(i for plan in plans for micro in plan for i in micro)
    assert seen == list(range(len(LENGTHS)))
    for plan in plans:
        for micro in plan:
            if len(micro) > 1:  # a lone over-long sample is allowed its own micro-batch
                assert len(micro) * max(LENGTHS[i] for i in micro) <= budget


def test_ranks_are_balanced_by_tokens() -> None:
    plans = assign_micro_batches(LENGTHS, 2, 1000)
    loads = [sum(LENGTHS[i] for micro in plan for i in micro) for plan in plans]
    assert abs(loads[0] - loads[1]) <= max(LENGTHS)


def test_padding_fraction_counts_cp_padding() -> None:
    plans = [[[0, 1]]]  # lengths 9 and 3 padded to 9: 6 of 18 are padding
    assert padding_fraction(LENGTHS, plans, cp_size=1) == pytest.approx(6 / 18)
    # CP=2 pads to a multiple of 4: width 12, 24 slots, 12 real.
    assert padding_fraction(LENGTHS, plans, cp_size=2) == pytest.approx(12 / 24)


def test_plan_ships_per_sample_coefficients_for_terms_and_every_mode() -> None:
    batch = random_train_batch(vocab_size=50)
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)
    plan = plan_step(batch, objective, dp_size=2, cp_size=1, max_tokens_per_micro_batch=32)
    assert plan.terms == ["pg", "kl", "entropy", "pg_loss/sample_mean", "pg_loss/token_mean",
                          "pg_loss/prompt_mean", "pg_loss/constant"]
    assert plan.dense_weights == {}
    for coefficients in plan.coefficients.values():
        assert coefficients.shape == (batch.num_samples,)
        assert coefficients.dtype == torch.float64
    # sample_mean: c_i = 1/(N·M_i), so one non-empty sample's weights sum to 1/N.
    counts = batch.sample_token_counts.double()
    nonempty = counts > 0
    sample_sums = plan.coefficients["pg"] * counts
    assert sample_sums[nonempty].tolist() == pytest.approx([1 / batch.num_samples] * int(
        nonempty.sum()))
    assert plan.coefficients["pg_loss/constant"].tolist() == pytest.approx(
        [1 / (8 * batch.num_samples)] * batch.num_samples)


def test_micro_batches_rebuild_the_dense_weights_exactly() -> None:
    batch = random_train_batch(vocab_size=50)
    objective = ObjectiveConfig.compose(AggregationConfig(mode="prompt_mean"), LossConfig(),
                                        8, 1.0)
    plan = plan_step(batch, objective, dp_size=2, cp_size=1, max_tokens_per_micro_batch=20)
    dense = token_weights(batch.loss_mask, batch.group_index, "prompt_mean")
    total = 0.0
    for rank_plan in plan.micro_batches:
        for samples in rank_plan:
            micro = slice_micro_batch(batch, plan, samples, cp_size=1, cp_rank=0)
            total += float(micro.weights["pg"].sum())
            if samples:  # shifted by one position: weight of token t sits at t−1
                width = micro.weights["pg"].shape[1]
                expected = dense[samples, 1:width]
                assert torch.equal(micro.weights["pg"][:, :-1], expected)
    assert total == pytest.approx(float(dense.sum()))


def test_plan_size_is_per_sample_not_per_token() -> None:
    """The plan that travels to every rank is O(N) per term, not O(N·S)."""
    batch = random_train_batch(vocab_size=50, num_prompts=8, group_size=4)
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)
    plan = plan_step(batch, objective, dp_size=2, cp_size=1, max_tokens_per_micro_batch=64)
    shipped = sum(c.numel() for c in plan.coefficients.values())
    assert shipped == len(plan.coefficients) * batch.num_samples
