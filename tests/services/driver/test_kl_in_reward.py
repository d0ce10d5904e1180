"""``driver_advantages`` (what rollout_step calls) with the KL in the reward, against
float64 references written here: GRPO's advantages over r_i − β·Σ_t k1 (the manager
leaves the estimator to the driver then: ``estimator_in_driver``), GAE's advantages and the
critic's targets over the token rewards r − β·k1; π_old from the trainer or the engine;
``kl/beta``, ``kl/mean`` and β's next value; β through a checkpoint folder exactly. A
planted error (a manager that applied the estimator anyway) fails the check. The policy and critic
groups are stand-ins that hand back fixed log-probs and values; the real verbs run in
tests/e2e/test_ppo.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from rollout.advantages import GAE, GRPO, Distill
from rollout.batch import RolloutBatch
from services.driver.advantages import KL_CONTROLLER_STATE, KLInReward, driver_advantages
from tests.rollout.test_kl_reward import (
    Case,
    kl_case,
    reference_sample_rewards,
    reference_token_rewards,
    response_rows,
    ziegler,
)
from trainer.config import KLControllerConfig, LossConfig

BETA, TARGET, HORIZON = 0.2, 1.5, 12


class Policy:
    """The policy's group as the driver calls it: its π_old and the reference's."""

    def __init__(self, case: Case) -> None:
        self.case, self.calls = case, []

    def log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        self.calls.append("log_probs")
        return self.case.old

    def reference_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        self.calls.append("reference_log_probs")
        return self.case.ref


class Critic:
    def __init__(self, values: torch.Tensor) -> None:
        self._values = values

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        return self._values


def kl_in_reward(old_log_probs: str = "trainer") -> KLInReward:
    kl = KLInReward.of(LossConfig(
        kl_coef=BETA, kl_placement="reward", old_log_probs=old_log_probs,
        kl_controller=KLControllerConfig(type="adaptive", target=TARGET, horizon=HORIZON)))
    assert kl is not None
    return kl


def reference_grpo(rewards: list[float], group_size: int, eps: float) -> list[float]:
    """(r − μ_g) / (σ_g + ε), σ Bessel-corrected."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [(r - mean) / (std + eps) for r in group]
    return out


def reference_gae(rewards: list[float], values: list[float], mask: list[float],
                  gamma: float, lam: float) -> list[float]:
    """GAE right to left over the valid tokens only, V after the last one 0."""
    out, running, next_value = [0.0] * len(mask), 0.0, 0.0
    for k in reversed([k for k, m in enumerate(mask) if m > 0]):
        running = rewards[k] + gamma * next_value - values[k] + gamma * lam * running
        out[k], next_value = running, values[k]
    return out


def mean_kl(case: Case) -> float:
    return sum(sum(o - r for o, r, m in zip(old, ref, mask, strict=True) if m > 0)
               for old, ref, mask in zip(case.old_lists, case.ref_lists, case.masks,
                                         strict=True)) / len(case.masks)


def check_grpo(case: Case, got: RolloutBatch) -> None:
    want = reference_grpo(reference_sample_rewards(case, BETA), 3, 1e-6)
    for i, (row, mask) in enumerate(zip(response_rows(case, got.advantages), case.masks,
                                        strict=True)):
        expected = [want[i] if m > 0 else 0.0 for m in mask]
        assert row == pytest.approx(expected, abs=2e-6, rel=0), i


def test_grpo_trains_on_rewards_less_the_kl_and_beta_moves() -> None:
    case = kl_case(3)
    estimator, kl, policy = GRPO(), kl_in_reward(), Policy(case)
    from_manager = case.batch  # rollout/manager.py leaves the estimator to the driver
    got = driver_advantages(from_manager, estimator, kl, policy, None, several_updates=False)
    assert got is not None
    check_grpo(case, got)
    assert got.old_log_probs is None  # one update: the ratio stays exactly 1
    assert got.metadata["kl/beta"] == BETA
    assert got.metadata["kl/mean"] == pytest.approx(mean_kl(case), abs=1e-12)
    assert kl.controller.beta == pytest.approx(
        ziegler(BETA, mean_kl(case), case.batch.num_samples, TARGET, HORIZON), rel=1e-14)
    assert policy.calls == ["log_probs", "reference_log_probs"]
    moved = kl.controller.beta  # the next step places the KL with the moved β
    again = driver_advantages(from_manager, estimator, kl, Policy(case), None, False)
    assert again is not None and again.metadata["kl/beta"] == moved != BETA


def test_a_manager_that_applied_the_estimator_too_fails_the_check() -> None:
    case = kl_case(3)
    estimator = GRPO()
    got = driver_advantages(estimator.apply(case.batch), estimator, kl_in_reward(),
                            Policy(case), None, several_updates=False)
    assert got is not None
    with pytest.raises(AssertionError):
        check_grpo(case, got)


def test_gae_and_the_critics_targets_see_the_kl_per_token() -> None:
    case = kl_case(4)
    generator = torch.Generator().manual_seed(4)
    values = torch.randn(case.batch.input_ids.shape, generator=generator)
    gamma, lam, critic_lam = 0.97, 0.9, 1.0
    estimator = GAE(gamma, lam, critic_lam, normalize=False)
    policy = Policy(case)
    got = driver_advantages(case.batch, estimator, kl_in_reward(), policy, Critic(values),
                            several_updates=True)
    assert got is not None and got.returns is not None
    assert torch.equal(got.old_log_probs, case.old)  # π_old for the rollout's updates too
    rewards = reference_token_rewards(case, BETA)
    value_rows = response_rows(case, values)
    for i, mask in enumerate(case.masks):
        want = reference_gae(rewards[i], value_rows[i], mask, gamma, lam)
        assert response_rows(case, got.advantages)[i] == pytest.approx(want, abs=1e-5), i
        target = reference_gae(rewards[i], value_rows[i], mask, gamma, critic_lam)
        target = [t + v if m > 0 else 0.0
                  for t, v, m in zip(target, value_rows[i], mask, strict=True)]
        assert response_rows(case, got.returns)[i] == pytest.approx(target, abs=1e-5), i
    assert "critic/explained_variance" in got.metadata and "kl/beta" in got.metadata


def test_the_engines_log_probs_are_pi_old_with_old_log_probs_rollout() -> None:
    case = kl_case(5)
    engine = dataclasses.replace(case.batch, rollout_log_probs=case.old)
    policy, estimator = Policy(case), GRPO()
    got = driver_advantages(engine, estimator, kl_in_reward("rollout"),
                            policy, None, several_updates=True)
    assert got is not None and got.old_log_probs is None
    assert policy.calls == ["reference_log_probs"]
    check_grpo(case, got)


def test_a_distilling_estimator_logs_the_kl_and_trains_as_before() -> None:
    case = kl_case(6)
    teacher = case.ref  # any log-probs
    batch = Distill(0.5).apply(case.batch, teacher_log_probs=teacher)
    got = driver_advantages(batch, Distill(0.5), kl_in_reward(), Policy(case), None, False)
    assert got is not None and torch.equal(got.advantages, batch.advantages)
    assert got.metadata["kl/mean"] == pytest.approx(mean_kl(case), abs=1e-12)


def test_without_the_kl_in_the_reward_the_managers_advantages_stand() -> None:
    assert KLInReward.of(LossConfig(kl_coef=0.1)) is None
    case = kl_case(7)
    batch = GRPO().apply(case.batch)
    assert driver_advantages(batch, GRPO(), None, Policy(case), None, True) is None


def test_beta_goes_through_a_checkpoint_folder_exactly(tmp_path: Path) -> None:
    kl = kl_in_reward()
    for mean in (0.3, 2.9, 0.01):  # β is now no short decimal
        kl.controller.update(mean, 7)
    kl.save(tmp_path)
    resumed, said = kl_in_reward(), []
    resumed.load(tmp_path, said.append)
    assert resumed.controller.beta == kl.controller.beta != BETA and not said
    fresh = kl_in_reward()
    (tmp_path / KL_CONTROLLER_STATE).unlink()
    fresh.load(tmp_path, said.append)  # a checkpoint of a run without it (--force)
    assert fresh.controller.beta == BETA and "holds no KL controller" in said[0]
