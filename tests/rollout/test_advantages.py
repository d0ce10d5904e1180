"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.advantages import (
    compute_advantages,
    explained_variance,
    gae,
    moments_mean_std,
    token_moments,
    whiten,
)
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


def _reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float
                   ) -> list[float]:
    """GAE over one sample's valid tokens by the textbook sum, in Python floats:
    A_k = Σ_{j≥k} (γλ)^{j−k} δ_j, δ_j = r_j + γ V_{j+1} − V_j (V after the last = 0)."""
    count = len(rewards)
    deltas = [rewards[j] + gamma * (values[j + 1] if j + 1 < count else 0.0) - values[j]
              for j in range(count)]
    return [sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, count))
            for k in range(count)]


def _ragged_batch_with_holes(seed: int) -> tuple[torch.Tensor, ...]:
    """Rewards, values and a loss mask [N, S] of ragged responses after prompts of
    different lengths, some with environment observations (mask 0) inside, and a
    fractional weight here and there; rewards only on valid tokens."""
    generator = torch.Generator().manual_seed(seed)
    n, width = 6, 24
    mask = torch.zeros(n, width)
    for i in range(n):
        start = int(torch.randint(1, 6, (), generator=generator))
        end = int(torch.randint(start + 1, width + 1, (), generator=generator))
        mask[i, start:end] = 1.0
        if end - start > 6 and i % 2:  # an observation of 2 tokens inside the response
            mask[i, start + 2:start + 4] = 0.0
        if i == 3:
            mask[i, end - 1] = 0.25
    values = torch.randn(n, width, generator=generator, dtype=torch.float64)
    rewards = torch.where(torch.rand(n, width, generator=generator) < 0.2,
                          torch.randn(n, width, generator=generator, dtype=torch.float64),
                          0.0) * (mask > 0)
    return rewards, values, mask


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0), (1.0, 0.0)])
def test_gae_equals_the_textbook_sum(gamma: float, lam: float) -> None:
    rewards, values, mask = _ragged_batch_with_holes(seed=int(gamma * 100 + lam * 10))
    advantages = gae(rewards, values, mask, gamma, lam)
    for i in range(mask.shape[0]):
        valid = (mask[i] > 0).nonzero().flatten().tolist()
        expected = _reference_gae(rewards[i, valid].tolist(), values[i, valid].tolist(),
                                  gamma, lam)
        assert advantages[i, valid].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert not advantages[i][mask[i] == 0].any()  # holes and padding stay 0


def test_gae_returns_at_critic_lam_one_are_monte_carlo() -> None:
    """R = A(λ = 1) + V is the discounted sum of the rewards after each token, whatever
    the values (the critic's unbiased target in VAPO's decoupled GAE)."""
    rewards, values, mask = _ragged_batch_with_holes(seed=7)
    returns = gae(rewards, values, mask, 0.9, 1.0) + values
    for i in range(mask.shape[0]):
        valid = (mask[i] > 0).nonzero().flatten().tolist()
        r = rewards[i, valid].tolist()
        expected = [sum(0.9 ** (j - k) * r[j] for j in range(k, len(r)))
                    for k in range(len(r))]
        assert returns[i, valid].tolist() == pytest.approx(expected, abs=1e-12)


def test_gae_with_a_final_reward_and_no_values_is_the_reward() -> None:
    """γ = λ = 1 and V = 0: every token of a response gets its final reward (what GRPO's
    per-sample advantage broadcasts, before the baseline)."""
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    rewards = torch.tensor([[0, 0, 0, 2.0, 0], [0, 0, 0, 0, -1.0]])
    advantages = gae(rewards, torch.zeros(2, 5), mask, 1.0, 1.0)
    assert advantages.tolist() == [[0, 2, 2, 2, 0], [0, 0, -1, -1, -1]]


def test_whitening_uses_the_moments_of_every_valid_token() -> None:
    rewards, values, mask = _ragged_batch_with_holes(seed=3)
    advantages = gae(rewards, values, mask, 1.0, 0.95)
    valid = advantages[mask > 0]
    moments = token_moments(advantages, mask)
    assert moments[0] == valid.numel()
    whitened = whiten(advantages, mask, moments, eps=0.0)
    expected = (valid - valid.mean()) / valid.std()
    assert whitened[mask > 0].tolist() == pytest.approx(expected.tolist(), abs=1e-12)
    assert not whitened[mask == 0].any()
    # Shards' moments add up to the whole's: split the samples any way.
    halves = token_moments(advantages[:2], mask[:2]) + token_moments(advantages[2:], mask[2:])
    assert halves.tolist() == pytest.approx(moments.tolist(), rel=1e-12)
    mean, std = moments_mean_std(halves)
    assert (mean, std) == pytest.approx((float(valid.mean()), float(valid.std())), rel=1e-12)


def test_explained_variance() -> None:
    rewards, values, mask = _ragged_batch_with_holes(seed=5)
    returns = gae(rewards, values, mask, 1.0, 1.0) + values
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    valid = returns[mask > 0]
    mean_only = torch.full_like(returns, float(valid.mean()))
    assert explained_variance(returns, mean_only, mask) == pytest.approx(0.0, abs=1e-12)
    assert explained_variance(returns, values, mask) < 1.0
