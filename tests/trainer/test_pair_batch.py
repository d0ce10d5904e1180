"""Preference pairs in the trainer: the step plan keeps each pair whole on one rank and
within the token budget, every rank with as many micro-batches; a micro-batch's rows
and score positions with their margins; the Bradley–Terry sums, and the loss with margin
and centring against its formula written out (split pairs sum to it, a per-part centring
mean does not)."""

from __future__ import annotations

import math
from collections.abc import Callable

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


# Margin and centring (issue 52): TRL's RewardTrainer loss,
# −mean log σ(r⁺ − r⁻ − m) + c · mean (r⁺ + r⁻)², its means over the step's P pairs.

WORKED_CHOSEN = [1.0, -0.5, 2.0, 0.3]
WORKED_REJECTED = [0.0, 0.5, 2.0, -1.2]
WORKED_MARGIN = [0.5, 0.0, -1.0, 2.0]
WORKED_C = 0.25


def _worked_by_hand(num_pairs: int) -> tuple[float, list[float], list[float]]:
    """The loss and its gradient in r⁺ and r⁻, written out pair by pair in Python floats:
    ℓ = log(1 + e^−(Δ−m)) + c (r⁺ + r⁻)², ∂ℓ/∂r± = ∓ 1/(1 + e^(Δ−m)) + 2c (r⁺ + r⁻)."""
    loss, d_chosen, d_rejected = 0.0, [], []
    for plus, minus, m in zip(WORKED_CHOSEN, WORKED_REJECTED, WORKED_MARGIN, strict=True):
        z = plus - minus - m
        loss += math.log1p(math.exp(-z)) + WORKED_C * (plus + minus) ** 2
        pull = 1.0 / (1.0 + math.exp(z))
        d_chosen.append((-pull + 2 * WORKED_C * (plus + minus)) / num_pairs)
        d_rejected.append((pull + 2 * WORKED_C * (plus + minus)) / num_pairs)
    return loss / num_pairs, d_chosen, d_rejected


def _worked_scores() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.tensor(WORKED_CHOSEN, dtype=torch.float64, requires_grad=True),
            torch.tensor(WORKED_REJECTED, dtype=torch.float64, requires_grad=True),
            torch.tensor(WORKED_MARGIN, dtype=torch.float64))


def test_margin_and_centring_loss_and_gradient_are_the_formula() -> None:
    chosen, rejected, margin = _worked_scores()
    objective, sums = pair_objective(chosen, rejected, 4, margin=margin,
                                     center_coefficient=WORKED_C)
    loss, d_chosen, d_rejected = _worked_by_hand(4)
    assert float(objective.detach()) == pytest.approx(loss, rel=1e-14)
    objective.backward()
    assert chosen.grad.tolist() == pytest.approx(d_chosen, rel=1e-13)
    assert rejected.grad.tolist() == pytest.approx(d_rejected, rel=1e-13)
    metrics = pair_metrics(sums, 4)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-14)
    assert metrics["loss/bradley_terry"] == pytest.approx(sum(
        math.log1p(math.exp(-(p - r - m))) for p, r, m in zip(
            WORKED_CHOSEN, WORKED_REJECTED, WORKED_MARGIN, strict=True)) / 4, rel=1e-14)
    assert metrics["score/centring"] == pytest.approx((1.0 + 0.0 + 16.0 + 0.81) / 4)
    assert metrics["accuracy"] == pytest.approx(2 / 4)  # TRL's: r⁺ > r⁻, margin aside
    assert metrics["margin"] == pytest.approx((1.0 - 1.0 + 0.0 + 1.5) / 4)


Objective = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _split_gradient(objective_fn: Objective, parts: list[list[int]]) -> torch.Tensor:
    """∇ in r⁺ of the sum of each part's objective (micro-batches or ranks), P = 4."""
    chosen, rejected, margin = _worked_scores()
    total = sum(objective_fn(chosen[part], rejected[part], 4, margin=margin[part],
                             center_coefficient=WORKED_C)[0] for part in parts)
    total.backward()
    return chosen.grad


def _centring_per_part(chosen: torch.Tensor, rejected: torch.Tensor, num_pairs: int,
                       margin: torch.Tensor, center_coefficient: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Planted error: the centring term averaged over the part's own pairs."""
    objective, sums = pair_objective(chosen, rejected, num_pairs, margin=margin)
    centring = center_coefficient * ((chosen + rejected) ** 2).mean()
    return objective + centring, sums


def test_split_pairs_sum_to_the_whole_and_a_per_part_centring_mean_does_not() -> None:
    whole = _split_gradient(pair_objective, [[0, 1, 2, 3]])
    _, d_chosen, _ = _worked_by_hand(4)
    assert whole.tolist() == pytest.approx(d_chosen, rel=1e-13)
    split = _split_gradient(pair_objective, [[0], [1, 3], [2]])
    assert torch.allclose(split, whole, rtol=1e-14, atol=0)
    planted = _split_gradient(_centring_per_part, [[0], [1, 3], [2]])
    assert not torch.allclose(planted, whole, rtol=1e-6, atol=0)


def test_margins_travel_with_their_pairs_into_each_micro_batch() -> None:
    batch = PairBatch.from_sequences([([5, 6], [5]), ([7], [7, 8]), ([9], [9])], pad_id=0,
                                     margins=[0.5, -1.0, 2.0])
    assert batch.margin_P.dtype == torch.float64
    for packed in (True, False):
        assert slice_pairs(batch, (0, 2), packed).margin.tolist() == [0.5, 2.0]
        assert slice_pairs(batch, (1,), packed).margin.tolist() == [-1.0]
        assert slice_pairs(batch, (), packed).weight == 0.0
    plain = PairBatch.from_sequences([([5, 6], [5])], pad_id=0)
    assert plain.margin_P is None and slice_pairs(plain, (0,), True).margin is None
    with pytest.raises(ValueError, match=r"margin is finite float64 \[P = 3\]"):
        PairBatch(batch.input_ids_NS, batch.lengths_N, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="margin is finite float64"):
        PairBatch(batch.input_ids_NS, batch.lengths_N,
                  torch.tensor([0.0, math.nan, 1.0], dtype=torch.float64))
