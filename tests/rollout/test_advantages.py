"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.advantages import compute_advantages
from rollout.config import AdvantageConfig

# Two groups of four: r = [1, 0, 0, 0 | 1, 1, 0, 0].
REWARDS = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
GROUPS = torch.tensor([5, 5, 5, 5, 6, 6, 6, 6])
EPS = 1e-6


def test_grpo_hand_computed() -> None:
    # Group 5: μ = 0.25, σ = sqrt((0.75² + 3·0.25²) / 3) = 0.5.
    # Group 6: μ = 0.5,  σ = sqrt(4·0.25 / 3) = 1/√3.
    s6 = 1 / math.sqrt(3)
    expected = [0.75 / 0.5, -0.5, -0.5, -0.5, 0.5 / s6, 0.5 / s6, -0.5 / s6, -0.5 / s6]
    got = compute_advantages(REWARDS, GROUPS, AdvantageConfig(type="grpo", eps=EPS))
    assert got.tolist() == pytest.approx(expected, abs=1e-5)


def test_dr_grpo_only_centres() -> None:
    got = compute_advantages(REWARDS, GROUPS, AdvantageConfig(normalize_std=False))
    assert got.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])


def test_reinforce_pp_whitens_over_the_batch() -> None:
    # a = r − μ_g = [.75, −.25, −.25, −.25, .5, .5, −.5, −.5]; mean(a) = 0;
    # std(a) = sqrt((.5625 + 3·.0625 + 4·.25) / 7) = 0.5.
    got = compute_advantages(REWARDS, GROUPS, AdvantageConfig(type="reinforce_pp", eps=EPS))
    assert got.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 1, 1, -1, -1], abs=1e-5)


def test_plain_reward_and_degenerate_groups() -> None:
    assert compute_advantages(REWARDS, GROUPS, AdvantageConfig(type="reward")).tolist() == (
        REWARDS.tolist()
    )
    flat = compute_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]), AdvantageConfig())
    assert flat.tolist() == [0.0] * 4  # no spread: no signal, and no NaN
    single = compute_advantages(torch.tensor([3.0, 1.0]), torch.tensor([0, 1]), AdvantageConfig())
    assert single.tolist() == [0.0, 0.0]


def test_groups_need_not_be_contiguous() -> None:
    interleaved = torch.tensor([5, 6, 5, 6, 5, 6, 5, 6])
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    config = AdvantageConfig()
    got = compute_advantages(REWARDS[order], interleaved, config)
    assert torch.allclose(got, compute_advantages(REWARDS, GROUPS, config)[order])
    with pytest.raises(ValueError, match=r"must both have shape \[N\]"):
        compute_advantages(REWARDS, GROUPS[:3], config)
