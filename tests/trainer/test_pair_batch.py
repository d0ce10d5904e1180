"""Preference pairs in the trainer: the step plan keeps each pair whole on one rank and
within the token budget, every rank with as many micro-batches; a micro-batch's rows
and score positions; the Bradley–Terry sums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.bradley_terry import pair_metrics, pair_objective
from trainer.pair_batch import PairBatch, plan_pairs, slice_pairs


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=2, max_size=40).filter(
    lambda x: len(x) % 2 == 0), dp=st.integers(1, 4), packed=st.booleans())
def test_plan_keeps_pairs_whole_within_budget_and_ranks_in_step(lengths: list[int], dp: int,
                                                                packed: bool) -> None:
    budget = 60
    plan = plan_pairs(torch.tensor(lengths), dp, budget, packed)
    num_pairs = len(lengths) // 2
    seen = [p for rank in plan.micro_batches for micro in rank for p in micro]
    assert sorted(seen) == list(range(num_pairs)) and plan.num_pairs == num_pairs
    assert len({len(rank) for rank in plan.micro_batches}) == 1  # FSDP stays in step
    assert len(plan.micro_batches) == dp
    computed = 0
    for rank in plan.micro_batches:
        for micro in rank:
            sides = [lengths[s] for p in micro for s in (2 * p, 2 * p + 1)]
            cost = sum(sides) if packed else len(sides) * max(sides, default=0)
            assert cost <= budget
            assert list(micro) == sorted(micro)
            computed += cost
    assert plan.computed_tokens == computed


def test_a_pair_over_the_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="pair 1: 70 tokens do not fit a micro-batch of 60"):
        plan_pairs(torch.tensor([3, 4, 40, 30]), 1, 60, packed=True)


def test_packed_and_padded_rows_read_each_sequence_at_its_last_token() -> None:
    batch = PairBatch.from_sequences([([5, 6, 7], [5, 8]), ([9], [9, 10, 11, 12])], pad_id=0)
    assert batch.num_pairs == 2
    assert batch.input_ids_NS.tolist() == [[5, 6, 7, 0], [5, 8, 0, 0], [9, 0, 0, 0],
                                           [9, 10, 11, 12]]
    packed = slice_pairs(batch, (0, 1), packed=True)
    assert packed.input_ids.tolist() == [[5, 6, 7, 5, 8, 9, 9, 10, 11, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]]
    assert packed.input_ids[packed.score_rows, packed.score_cols].tolist() == [7, 8, 9, 12]
    packed.layout.check(packed.position_ids)
    padded = slice_pairs(batch, (1,), packed=False)
    assert padded.input_ids.tolist() == [[9, 0, 0, 0], [9, 10, 11, 12]]
    assert padded.input_ids[padded.score_rows, padded.score_cols].tolist() == [9, 12]
    assert padded.layout is None and padded.weight == 1.0
    empty = slice_pairs(batch, (), packed=True)  # keeps FSDP in step, counts for nothing
    assert empty.weight == 0.0 and empty.input_ids.numel() > 0


def test_batch_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match=r"input_ids \[2P, S\]"):
        PairBatch(torch.zeros(3, 4, dtype=torch.int64), torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="between 1 and the row width"):
        PairBatch(torch.zeros(2, 4, dtype=torch.int64), torch.tensor([0, 4]))


def test_bradley_terry_sums_are_the_formula() -> None:
    chosen = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.0, 0.5, 2.0], dtype=torch.float64)
    objective, sums = pair_objective(chosen, rejected, num_pairs=6)
    expected = -F.logsigmoid(chosen - rejected).sum() / 6
    assert torch.allclose(objective, expected)
    objective.backward()
    assert torch.allclose(chosen.grad, -torch.sigmoid(rejected - chosen) / 6)
    metrics = pair_metrics(sums, 3)
    assert metrics["accuracy"] == pytest.approx(1 / 3)  # a tie is not a win
    assert metrics["margin"] == pytest.approx((1.0 - 1.0 + 0.0) / 3)
    assert metrics["score/chosen"] == pytest.approx(2.5 / 3)
    zero, zero_sums = pair_objective(chosen, rejected, 6, weight=0.0)
    assert float(zero.detach()) == 0.0 and not zero_sums.any()
