"""The length-bias view: each mode's share of a step's weight on its short, middle and
long third of responses, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.aggregation import AGGREGATION_MODES, LENGTH_BUCKETS, length_bias

# Two groups of three (A: 1, 2, 9 tokens; B: 3, 3, 4), interleaved so that index order is
# not length order. By (M_i, i): short = {1, 2} (A), middle = {3, 3} (B), long = {4 (B),
# 9 (A)}. T_A = 12, T_B = 10, Σ M = 22, N = 6, P = 2.
COUNTS = torch.tensor([9, 3, 1, 4, 2, 3])
GROUPS = torch.tensor([0, 1, 0, 1, 0, 1])
DIVISOR = 8.0
EXPECTED = {
    "sample_mean": (2 / 6, 2 / 6, 2 / 6),
    "token_mean": (3 / 22, 6 / 22, 13 / 22),
    # W_i = M_i / (P · T_g): A gives 1/24, 2/24, 9/24; B gives 3/20, 3/20, 4/20.
    "prompt_mean": (3 / 24, 6 / 20, 9 / 24 + 4 / 20),
    "constant": (3 / 22, 6 / 22, 13 / 22),
}


def assert_shares(actual: dict[str, tuple[float, float, float]],
                  expected: dict[str, tuple[float, float, float]]) -> None:
    assert set(actual) == set(expected)
    for mode, shares in expected.items():
        assert actual[mode] == pytest.approx(shares, rel=1e-12, abs=1e-15), mode


def test_hand_computed_shares_where_the_modes_differ() -> None:
    shares = length_bias(COUNTS, GROUPS, DIVISOR)
    assert_shares(shares, EXPECTED)
    assert list(shares) == list(AGGREGATION_MODES)
    assert LENGTH_BUCKETS == ("short", "middle", "long")
    long = {mode: shares[mode][2] for mode in shares}
    assert long["sample_mean"] < long["prompt_mean"] < long["token_mean"]


def test_buckets_follow_length_not_position() -> None:
    # Cutting COUNTS by index would make {9, 3} the short third (token_mean 12/22, not
    # 3/22); any order of the same samples must give the same shares.
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        order = torch.randperm(len(COUNTS), generator=generator)
        assert_shares(length_bias(COUNTS[order], GROUPS[order], DIVISOR), EXPECTED)


def test_ties_are_broken_by_index() -> None:
    # Lengths 2 at index 1 (group 0, T = 14) and index 3 (group 1, T = 9) straddle the
    # short/middle cut: index 1 is short. prompt_mean W_i = M_i / (2 T_g) tells them apart.
    counts = torch.tensor([9, 2, 3, 2, 6, 1])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    short, middle, long = length_bias(counts, groups, DIVISOR)["prompt_mean"]
    assert short == pytest.approx(1 / 18 + 2 / 28)
    assert middle == pytest.approx(2 / 18 + 3 / 28)
    assert long == pytest.approx(6 / 18 + 9 / 28)


@pytest.mark.parametrize(("num_samples", "sizes"), [
    (1, (0, 1, 0)), (2, (1, 0, 1)), (3, (1, 1, 1)), (4, (1, 2, 1)), (5, (2, 1, 2)),
    (6, (2, 2, 2)), (7, (2, 3, 2)),
])
def test_sample_mean_shares_are_bucket_sizes_over_n(num_samples: int,
                                                     sizes: tuple[int, int, int]) -> None:
    counts = torch.arange(num_samples, 0, -1) * 3  # every response non-empty, descending
    groups = torch.arange(num_samples)
    shares = length_bias(counts, groups, DIVISOR)
    assert shares["sample_mean"] == pytest.approx(tuple(s / num_samples for s in sizes))


def test_shares_sum_to_one_and_token_mean_equals_constant() -> None:
    generator = torch.Generator().manual_seed(0)
    for num_groups, group_size in ((1, 1), (2, 4), (5, 3), (16, 8)):
        counts = torch.randint(0, 50, (num_groups * group_size,), generator=generator)
        counts[0] = 7  # at least one valid token
        groups = torch.arange(num_groups).repeat_interleave(group_size)
        for divisor in (1.0, 64.0):
            shares = length_bias(counts, groups, divisor, group_size=group_size)
            for mode in AGGREGATION_MODES:
                assert sum(shares[mode]) == pytest.approx(1.0, abs=1e-12), mode
                assert all(s >= 0 for s in shares[mode])
            assert shares["token_mean"] == pytest.approx(shares["constant"], abs=1e-15)


def test_zero_length_samples_carry_no_weight() -> None:
    # Sorted: 0 (i0) | 0 (i1), 2 (i2) | 4 (i3); group 0 has no valid token at all.
    counts = torch.tensor([0, 0, 2, 4])
    groups = torch.tensor([0, 0, 1, 1])
    assert_shares(length_bias(counts, groups, DIVISOR), {
        "sample_mean": (0.0, 1 / 2, 1 / 2),  # W = 1/4 for the two non-empty responses
        "token_mean": (0.0, 1 / 3, 2 / 3),
        "prompt_mean": (0.0, 1 / 3, 2 / 3),  # 1/(2·6)·2 and 1/(2·6)·4 of a total 1/2
        "constant": (0.0, 1 / 3, 2 / 3),
    })


def test_a_step_without_valid_tokens_has_all_shares_zero() -> None:
    shares = length_bias(torch.zeros(6, dtype=torch.int64), GROUPS, DIVISOR)
    assert shares == {mode: (0.0, 0.0, 0.0) for mode in AGGREGATION_MODES}


def test_incomplete_groups_leave_prompt_mean_out() -> None:
    shares = length_bias(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1]), DIVISOR)
    assert all(math.isnan(s) for s in shares["prompt_mean"])
    assert sum(shares["token_mean"]) == pytest.approx(1.0)
