from __future__ import annotations

import pytest

from tests.trainer.helpers import random_train_batch
from trainer.config import LossConfig
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


def test_plan_weights_cover_terms_and_every_mode() -> None:
    batch = random_train_batch(vocab_size=50)
    plan = plan_step(batch, LossConfig(), dp_size=2, cp_size=1,
                     max_tokens_per_micro_batch=32, max_response_len=8)
    assert {"pg", "kl", "entropy", "pg_loss/sample_mean", "pg_loss/token_mean",
            "pg_loss/prompt_mean", "pg_loss/constant"} <= set(plan.weights)
    for weights in plan.weights.values():
        assert weights.shape == batch.loss_mask.shape
        assert (weights[batch.loss_mask == 0] == 0).all()
    # sample_mean weights of one non-empty sample sum to 1/N.
    sample_sums = plan.weights["pg"].sum(dim=1)
    nonempty = batch.sample_token_counts > 0
    assert sample_sums[nonempty].tolist() == pytest.approx([1 / batch.num_samples] * int(
        nonempty.sum()))
