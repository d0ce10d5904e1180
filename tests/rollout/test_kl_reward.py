"""The KL in the reward (rollout/kl_reward.py) against float64 references written here
with plain loops over Python floats, apart from production: each valid token's reward
less β·k1 (GAE's token rewards, a multi-turn sample's per-turn rewards too), each
sample's reward less β·Σ_t k1 for the estimators without token rewards, and Ziegler et
al.'s adaptive β over several steps, both ways and clipped. Two planted errors (the
penalty added instead of taken off; the per-sample reward left without it) fail the
checks."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from rollout.advantages import GAE, GRPO, ReinforcePP, Reward
from rollout.advantages import base as base_module
from rollout.batch import RolloutBatch
from rollout.kl_reward import KLController, kl_per_token


@dataclass(frozen=True)
class Case:
    """A rollout as plain lists (the reference's view) and as the batch production reads,
    with the trainer's π_old and the reference's log-probs [N, S] aligned with it."""

    batch: RolloutBatch
    old: torch.Tensor
    ref: torch.Tensor
    masks: list[list[float]]
    old_lists: list[list[float]]
    ref_lists: list[list[float]]
    turns: list[list[tuple[int, float]]]
    """Each sample's rewards by response position (its reward on its last valid token,
    or an environment's per-turn rewards)."""


def kl_case(seed: int = 0, groups: int = 2, group_size: int = 3) -> Case:
    """Ragged samples in ``groups`` groups: an observation of two tokens (mask 0) inside
    some responses, per-turn rewards on one, a sample whose response is all observation."""
    rng = random.Random(seed)
    n = groups * group_size
    prompts, responses, masks, turns, rewards, olds, refs = [], [], [], [], [], [], []
    for i in range(n):
        length = rng.randint(3 if i == 0 else 1, 7)  # sample 0: an episode of two turns
        prompts.append([1] * rng.randint(1, 3))
        responses.append([rng.randint(3, 30) for _ in range(length)])
        mask = [1] * length
        if length > 4 and i % 2:
            mask[1] = mask[2] = 0
        if i == n - 1:
            mask = [0] * length  # nothing valid: no reward placed, no KL
        masks.append(mask)
        reward = rng.choice([0.0, 1.0, -0.5, 2.0])
        rewards.append(reward)
        valid = [k for k, m in enumerate(mask) if m]
        if i == 0 and len(valid) > 2:  # an episode: two steps' rewards
            turns.append([(valid[0], 0.25), (valid[-1], reward - 0.25)])
        else:
            turns.append([(valid[-1], reward)] if valid else [])
        olds.append([rng.uniform(-3.0, -0.05) for _ in range(length)])
        refs.append([rng.uniform(-3.0, -0.05) for _ in range(length)])
    batch = RolloutBatch.from_samples(
        prompt_ids=prompts, response_ids=responses,
        response_log_probs=[[-1.0] * len(r) for r in responses], rewards=rewards,
        advantages=[0.0] * n, group_index=[i // group_size for i in range(n)],
        samples_per_prompt=group_size, response_masks=masks,
        turn_rewards=turns)
    old = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    ref = torch.zeros_like(old)
    for i in range(n):
        start = int(batch.prompt_lengths[i])
        old[i, start:start + len(olds[i])] = torch.tensor(olds[i])
        ref[i, start:start + len(refs[i])] = torch.tensor(refs[i])
    # the reference reads the float32 values production reads
    old_lists = [[float(old[i, int(batch.prompt_lengths[i]) + k]) for k in range(len(o))]
                 for i, o in enumerate(olds)]
    ref_lists = [[float(ref[i, int(batch.prompt_lengths[i]) + k]) for k in range(len(r))]
                 for i, r in enumerate(refs)]
    return Case(batch, old, ref, [[float(m) for m in mask] for mask in masks], old_lists,
                ref_lists, turns)


def reference_token_rewards(case: Case, beta: float) -> list[list[float]]:
    """Per response position: the reward placed there, less β·(log π_old − log π_ref) on
    a valid token."""
    out = []
    for mask, old, ref, turns in zip(case.masks, case.old_lists, case.ref_lists, case.turns,
                                     strict=True):
        row = [0.0] * len(mask)
        for position, reward in turns:
            row[position] += reward
        for k, m in enumerate(mask):
            if m > 0:
                row[k] -= beta * (old[k] - ref[k])
        out.append(row)
    return out


def reference_sample_rewards(case: Case, beta: float) -> list[float]:
    """r_i − β·Σ over the valid tokens of (log π_old − log π_ref)."""
    rewards = case.batch.rewards.tolist()
    return [rewards[i] - beta * sum(o - r for o, r, m in zip(old, ref, mask, strict=True)
                                    if m > 0)
            for i, (mask, old, ref) in enumerate(zip(case.masks, case.old_lists,
                                                     case.ref_lists, strict=True))]


def response_rows(case: Case, tensor: torch.Tensor) -> list[list[float]]:
    """``tensor`` [N, S]'s response positions, as the reference's lists."""
    return [[float(tensor[i, int(case.batch.prompt_lengths[i]) + k])
             for k in range(len(mask))] for i, mask in enumerate(case.masks)]


def check_placement(case: Case, beta: float) -> None:
    """What each estimator reads with the KL in the reward equals the reference: GAE's
    token rewards, and every built-in's per-sample rewards."""
    penalty = beta * kl_per_token(case.old, case.ref, case.batch.loss_mask)  # the driver's
    values = torch.zeros(case.batch.input_ids.shape)
    token_inputs = GAE().inputs(case.batch, values=values, kl_penalty=penalty)
    assert token_inputs.token_rewards is not None
    got = response_rows(case, token_inputs.token_rewards)
    for got_row, want_row in zip(got, reference_token_rewards(case, beta), strict=True):
        assert got_row == pytest.approx(want_row, abs=1e-12, rel=0)
    want = reference_sample_rewards(case, beta)
    for estimator in (GRPO(), ReinforcePP(), Reward(), GAE()):
        inputs = estimator.inputs(case.batch, values=values, kl_penalty=penalty)
        assert inputs.rewards.tolist() == pytest.approx(want, abs=1e-6, rel=0), estimator


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_estimator_reads_its_rewards_less_beta_times_k1(seed: int) -> None:
    case = kl_case(seed)
    assert case.batch.loss_mask[-1].sum() == 0 and len(case.turns[0]) == 2
    check_placement(case, beta=0.37)
    # without the KL the rewards are the batch's own
    assert torch.equal(GRPO().inputs(case.batch).rewards, case.batch.rewards)


def test_a_planted_sign_error_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    case = kl_case(0)
    monkeypatch.setattr(base_module, "penalized_token_rewards",
                        lambda rewards, penalty: rewards.double() + penalty)
    with pytest.raises(AssertionError):
        check_placement(case, beta=0.37)


def test_a_per_sample_reward_without_the_kl_fails_the_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    case = kl_case(0)
    monkeypatch.setattr(base_module, "penalized_rewards", lambda rewards, penalty: rewards)
    with pytest.raises(AssertionError):
        check_placement(case, beta=0.37)


def ziegler(beta: float, mean_kl: float, num_samples: int, target: float,
            horizon: int) -> float:
    """Ziegler et al. (2019), as the paper writes it: e_t = clip(KL/target − 1, ±0.2),
    β_{t+1} = β_t (1 + K_β e_t), K_β = n / horizon."""
    error = max(-0.2, min(0.2, mean_kl / target - 1.0))
    return beta * (1.0 + error * num_samples / horizon)


def test_the_adaptive_beta_follows_zieglers_rule_toward_the_target() -> None:
    target, horizon, n = 2.0, 64, 16
    controller = KLController(0.1, adaptive=True, target=target, horizon=horizon)
    beta = 0.1
    # far above (clipped at +0.2), just above, far below (clipped at −0.2), just below,
    # on target
    for mean_kl in (9.0, 2.3, 0.0, 1.7, 2.0, 30.0, 0.5):
        before = controller.beta
        got = controller.update(mean_kl, n)
        beta = ziegler(beta, mean_kl, n, target, horizon)
        assert got == pytest.approx(beta, rel=1e-14) and controller.beta == got
        if mean_kl > target:
            assert got > before  # the KL is too large: a stronger penalty
        elif mean_kl < target:
            assert got < before  # too small: a weaker one
        else:
            assert got == before
    clipped = KLController(1.0, adaptive=True, target=1.0, horizon=10)
    assert clipped.update(100.0, 10) == pytest.approx(1.2)
    assert clipped.update(0.0, 10) == pytest.approx(1.2 * 0.8)


def test_a_fixed_beta_stays_and_the_state_is_beta() -> None:
    controller = KLController(0.05)
    for mean_kl in (0.0, 3.0, 100.0):
        assert controller.update(mean_kl, 256) == 0.05
    other = KLController(1.0, adaptive=True)
    other.load_state_dict(KLController(0.123456789012345).state_dict())
    assert other.beta == 0.123456789012345
    with pytest.raises(ValueError, match="beta"):
        other.load_state_dict({"beta": -1.0})
