"""The advantage-estimator registry: every built-in ``type`` resolves to its class with
its settings, ``type: custom`` to a user's subclass by ``class_path``, anything else is
refused naming the field; and the contract every estimator is held to (shape, mask,
what it declared it needs)."""

from __future__ import annotations

import typing

import pytest
import torch

from rollout.advantages import (
    BUILTIN,
    GAE,
    GRPO,
    AdvantageEstimator,
    Distill,
    ReinforcePP,
    Reward,
    build_estimator,
    compute_advantages,
    estimator_class,
    grpo_advantages,
)
from rollout.batch import RolloutBatch
from rollout.config import AdvantageConfig
from rollout.plugins import PluginError
from tests.rollout.toy_estimators import DrGRPO

TOYS = "tests.rollout.toy_estimators"
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def _batch() -> RolloutBatch:
    """Two groups of four, responses of 1–3 tokens, the second sample's middle token an
    environment's observation (mask 0)."""
    responses = [[5, 6, 7], [5, 6], [5], [7, 7], [6, 6, 6], [5], [7], [6, 5]]
    masks = [[1] * len(r) for r in responses]
    masks[4] = [1, 0, 1]
    return RolloutBatch.from_samples(
        prompt_ids=[[1, 2]] * 8, response_ids=responses,
        response_log_probs=[[-0.5] * len(r) for r in responses], rewards=REWARDS,
        advantages=[0.0] * 8, group_index=[3, 3, 3, 3, 4, 4, 4, 4], samples_per_prompt=4,
        response_masks=masks)


def test_every_builtin_type_resolves_with_its_settings() -> None:
    types = set(typing.get_args(AdvantageConfig.model_fields["type"].annotation))
    assert types == {*BUILTIN, "custom"}  # a new type needs its registry entry
    configs = {"grpo": AdvantageConfig(normalize_std=False, eps=0.5),
               "reinforce_pp": AdvantageConfig(type="reinforce_pp", eps=0.25),
               "reward": AdvantageConfig(type="reward"),
               "distill": AdvantageConfig(type="distill", teacher="tiny", coef=0.5),
               "gae": AdvantageConfig(type="gae", gamma=0.9, lam=0.8, normalize=True)}
    classes = {"grpo": GRPO, "reinforce_pp": ReinforcePP, "reward": Reward,
               "distill": Distill, "gae": GAE}
    for name, config in configs.items():
        estimator = build_estimator(config)
        assert estimator_class(config) is classes[name] and type(estimator) is classes[name]
        assert isinstance(estimator, AdvantageEstimator)
    assert vars(build_estimator(configs["grpo"])) == {"normalize_std": False, "eps": 0.5}
    assert vars(build_estimator(configs["distill"])) == {"coef": 0.5}
    assert vars(build_estimator(configs["gae"])) == {
        "gamma": 0.9, "lam": 0.8, "critic_lam": 1.0, "normalize": True, "eps": 1e-6,
        "bootstrap_truncated": False}


def test_what_each_builtin_declares_it_needs() -> None:
    needs = {name: (c.needs_critic, c.needs_teacher, c.needs_token_rewards,
                    c.needs_reward_spread, c.uses_rewards) for name, (c, _) in BUILTIN.items()}
    assert needs == {"grpo": (False, False, False, True, True),
                     "reinforce_pp": (False, False, False, True, True),
                     "reward": (False, False, False, False, True),
                     "distill": (False, True, False, False, False),
                     "gae": (True, False, True, False, True)}


def test_a_custom_class_resolves_with_its_kwargs_and_equals_dr_grpo() -> None:
    config = AdvantageConfig(type="custom", class_path=f"{TOYS}:DrGRPO",
                             kwargs={"scale": 2.0})
    estimator = build_estimator(config)
    assert type(estimator) is DrGRPO and estimator.scale == 2.0
    batch = estimator.apply(_batch())
    dr_grpo = grpo_advantages(batch.rewards, batch.group_index, normalize_std=False)
    want = torch.where(batch.loss_mask > 0, 2.0 * dr_grpo[:, None], 0.0)
    assert torch.equal(batch.advantages, want)
    assert batch.advantages[4].count_nonzero() == 2  # the observation token stays 0
    assert compute_advantages(batch.rewards, batch.group_index, config).tolist() == (
        (2.0 * dr_grpo).tolist())


@pytest.mark.parametrize(("name", "what"), [("NotAnEstimator", "a class"),
                                            ("not_a_class", "a function")])
def test_a_class_path_that_is_no_estimator_subclass_is_refused_naming_the_field(
        name: str, what: str) -> None:
    config = AdvantageConfig(type="custom", class_path=f"{TOYS}:{name}")
    with pytest.raises(PluginError) as err:
        build_estimator(config)
    assert str(err.value) == (
        f"rollout.advantage.class_path: {TOYS}:{name} is {what} that does not subclass "
        "rollout.advantages.AdvantageEstimator; an estimator must (class MyEstimator("
        "AdvantageEstimator), docs/extending.md)")


def test_kwargs_the_class_does_not_take_are_refused_naming_the_field() -> None:
    config = AdvantageConfig(type="custom", class_path=f"{TOYS}:DrGRPO",
                             kwargs={"scael": 2.0})
    with pytest.raises(ValueError, match=r"^rollout\.advantage\.kwargs: .*'scael'"):
        build_estimator(config)


def test_an_estimator_must_return_one_advantage_per_token() -> None:
    wrong = build_estimator(AdvantageConfig(type="custom", class_path=f"{TOYS}:WrongShape"))
    with pytest.raises(ValueError, match=r"^WrongShape returned \(8,\), not advantages "
                                         r"of shape \(8, 5\)"):
        wrong.apply(_batch())


def test_what_an_estimator_declares_is_handed_to_it_and_nothing_else() -> None:
    batch = _batch()
    with pytest.raises(ValueError, match="Distill needs teacher_log_probs"):
        Distill().apply(batch)
    with pytest.raises(ValueError, match="GAE needs values"):
        GAE().apply(batch)
    teacher = batch.rollout_log_probs - 0.25 * batch.loss_mask
    inputs = GRPO().inputs(batch, values=torch.ones_like(teacher), teacher_log_probs=teacher)
    assert inputs.values is None and inputs.teacher_log_probs is None
    assert inputs.token_rewards is None
    gae_inputs = GAE().inputs(batch, values=torch.zeros_like(teacher))
    assert torch.equal(gae_inputs.token_rewards, batch.placed_rewards())
    distilled = Distill(coef=2.0).apply(batch, teacher_log_probs=teacher)
    assert torch.equal(distilled.advantages, -0.5 * batch.loss_mask)


def test_builtin_estimators_add_to_the_advantages_already_there() -> None:
    """A rollout.teacher's term and GAE's: each estimator adds, never overwrites."""
    batch = _batch()
    once = GRPO().apply(batch)
    twice = GRPO().apply(once)
    assert torch.equal(twice.advantages, 2 * once.advantages)
    assert once.advantages.abs().sum() > 0


def _reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float
                   ) -> list[float]:
    """A_k = Σ_j (γλ)^j δ_{k+j} over one sample's valid tokens, written out."""
    deltas = [rewards[k] + gamma * (values[k + 1] if k + 1 < len(values) else 0.0)
              - values[k] for k in range(len(values))]
    return [sum((gamma * lam) ** j * deltas[k + j] for j in range(len(deltas) - k))
            for k in range(len(deltas))]


def test_gae_apply_stores_values_targets_and_adds_the_advantages() -> None:
    batch = GRPO().apply(_batch())  # something already there: GAE adds to it
    values = torch.linspace(0.1, 0.9, 40).reshape(8, 5) * batch.loss_mask
    estimator = GAE(gamma=0.9, lam=0.8, critic_lam=1.0)
    out = estimator.apply(batch, values=values)
    placed = batch.placed_rewards()
    for i in range(8):
        valid = (batch.loss_mask[i] > 0).nonzero().flatten()
        r, v = placed[i, valid].tolist(), values[i, valid].tolist()
        want = torch.tensor(_reference_gae(r, v, 0.9, 0.8), dtype=torch.float32)
        got = out.advantages[i, valid] - batch.advantages[i, valid]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        returns = [a + b for a, b in zip(_reference_gae(r, v, 0.9, 1.0), v, strict=True)]
        torch.testing.assert_close(out.returns[i, valid], torch.tensor(returns), rtol=0,
                                   atol=1e-6)
    assert torch.equal(out.values, values)
    assert {"critic/explained_variance", "critic/returns_mean", "critic/advantages_mean",
            "critic/advantages_std"} <= out.metadata.keys()
    whitened = GAE(gamma=0.9, lam=0.8, normalize=True).apply(batch, values=values)
    gained = (whitened.advantages - batch.advantages)[batch.loss_mask > 0].double()
    assert abs(float(gained.mean())) < 1e-6 and abs(float(gained.std()) - 1) < 1e-4
