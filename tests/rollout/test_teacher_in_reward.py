"""``rollout.teacher.placement: reward`` under gae: the teacher's per-token term
c · (log π_teacher − log π_old) goes into the token rewards GAE reads, so the critic's
targets credit it; ``placement: advantage`` (the default) adds it to GAE's advantages as
before. Through the functions production calls — the manager's ``_with_advantages`` (on
a stand-in manager holding the teacher's log-probs: the real teacher actors run in
tests/rollout/test_teacher.py), then the driver's ``driver_advantages`` — against GAE's
recursion written out here in float64 loops."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from rollout.advantages import Distill, build_estimator
from rollout.batch import RolloutBatch
from rollout.config import AdvantageConfig, RolloutConfig, TeacherConfig
from rollout.manager import RolloutManager
from services.driver.advantages import driver_advantages

COEF, GAMMA, LAM, CRITIC_LAM = 0.3, 0.9, 0.8, 1.0


class Critic:
    def __init__(self, values: torch.Tensor) -> None:
        self._values = values

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        return self._values


class Manager:
    """What ``RolloutManager._with_advantages`` reads of its manager; the teacher's
    log-probs are given instead of scored by teacher actors."""

    def __init__(self, placement: str, teacher: torch.Tensor) -> None:
        self.teacher = TeacherConfig(model="tiny", coef=COEF, placement=placement)
        self.estimator = build_estimator(AdvantageConfig(type="gae", gamma=GAMMA, lam=LAM,
                                                         critic_lam=CRITIC_LAM))
        self.estimator_in_driver = True  # gae needs the critic: the driver applies it
        self._teacher = teacher

    def _teacher_log_probs(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        return self._teacher, {"distill/reverse_kl": 0.0}


def _case(seed: int) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
    """A rollout of two groups of three (ragged; an episode's observation tokens, mask 0,
    inside some responses, with two steps' rewards), the teacher's log-probs and the
    critic's values [N, S]; and each sample written out as the reference reads it."""
    rng = random.Random(seed)
    prompts, responses, log_probs, masks, turns, rewards, rows = [], [], [], [], [], [], []
    for i in range(6):
        length = rng.randint(2, 8)
        prompts.append([1] * rng.randint(1, 3))
        responses.append([rng.randint(3, 30) for _ in range(length)])
        mask = [1] * length
        if length > 5 and i % 2:
            mask[2] = mask[3] = 0  # an observation of two tokens
        masks.append(mask)
        log_probs.append([rng.uniform(-2.0, -0.1) if m else 0.0 for m in mask])
        reward = rng.choice([0.0, 1.0, -0.5])
        rewards.append(reward)
        valid = [k for k, m in enumerate(mask) if m]
        turns.append([(valid[0], 0.25), (valid[-1], reward - 0.25)] if len(valid) > 2
                     else [(valid[-1], reward)])
    batch = RolloutBatch.from_samples(prompts, responses, log_probs, rewards,
                                      [0.0] * 6, [i // 3 for i in range(6)], 3,
                                      response_masks=masks, turn_rewards=turns)
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(batch.loss_mask.shape, generator=gen) - 1.0  # noise off it too
    values = torch.randn(batch.loss_mask.shape, generator=gen)
    for i in range(6):
        start = len(prompts[i])
        rows.append({"cols": [start + k for k, m in enumerate(masks[i]) if m],
                     "placed": {start + k: r for k, r in turns[i]}, "lp": log_probs[i],
                     "start": start})
    return batch, teacher, values, rows


def reference(rows: list[dict[str, Any]], teacher: torch.Tensor, values: torch.Tensor,
              width: int, in_reward: bool, eps: float = 1e-6
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, R) [N, S] float64 by loops over each sample's valid tokens k = 1 … K:
    d_k = c (log π_teacher − log π_old); r_k the placed reward, plus d_k ``in_reward``;
    δ_k = r_k + γ V_{k+1} − V_k (V_{K+1} = 0), A_k = δ_k + γλ A_{k+1}, R = A(critic_lam)
    + V; A whitened by the valid tokens' mean and std (n − 1), then + d_k when not
    ``in_reward`` (the teacher's advantage on top)."""
    t_rows, v_rows = teacher.double().tolist(), values.double().tolist()
    adv = [[0.0] * width for _ in rows]
    ret = [[0.0] * width for _ in rows]
    for i, row in enumerate(rows):
        cols = row["cols"]
        d = [COEF * (t_rows[i][t] - row["lp"][t - row["start"]]) for t in cols]
        r = [row["placed"].get(t, 0.0) + (d[k] if in_reward else 0.0)
             for k, t in enumerate(cols)]
        v = [v_rows[i][t] for t in cols]
        for lam_, out, plus_v in ((LAM, adv, False), (CRITIC_LAM, ret, True)):
            running, next_value = 0.0, 0.0
            for k in range(len(cols) - 1, -1, -1):
                running = r[k] + GAMMA * next_value - v[k] + GAMMA * lam_ * running
                out[i][cols[k]] = running + (v[k] if plus_v else 0.0)
                next_value = v[k]
        row["d"] = d
    valid = [(i, t) for i, row in enumerate(rows) for t in row["cols"]]
    flat = [adv[i][t] for i, t in valid]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    for i, row in enumerate(rows):
        for k, t in enumerate(row["cols"]):
            adv[i][t] = (adv[i][t] - mean) / (std + eps) + (0.0 if in_reward else row["d"][k])
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def _through_production(placement: str, seed: int) -> tuple[RolloutBatch, RolloutBatch]:
    batch, teacher, values, _ = _case(seed)
    manager = Manager(placement, teacher)
    handed = RolloutManager._with_advantages(manager, batch)  # type: ignore[arg-type]
    out = driver_advantages(handed, manager.estimator, None, None, Critic(values), False)
    assert out is not None
    return handed, out


@pytest.mark.parametrize("placement", ["advantage", "reward"])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_placement_is_the_recursion_written_out(placement: str, seed: int) -> None:
    batch, teacher, values, rows = _case(seed)
    _, out = _through_production(placement, seed)
    assert out.returns is not None
    width = batch.loss_mask.shape[1]
    want_a, want_r = reference(rows, teacher, values, width, in_reward=placement == "reward")
    torch.testing.assert_close(out.advantages.double(), want_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.returns.double(), want_r, rtol=1e-5, atol=1e-5)
    # the other placement is another answer: the check tells them apart
    other_a, other_r = reference(rows, teacher, values, width,
                                 in_reward=placement != "reward")
    assert (out.returns.double() - other_r).abs().max() > 1e-2
    assert (out.advantages.double() - other_a).abs().max() > 1e-2


def test_in_the_reward_the_critic_credits_the_teacher_and_the_task_reward_stays() -> None:
    batch, teacher, _, _ = _case(2)
    handed, _ = _through_production("reward", 2)
    assert torch.equal(handed.rewards, batch.rewards)  # logged as the task's
    assert torch.equal(handed.advantages, batch.advantages)  # nothing on top
    term = torch.where(batch.loss_mask > 0,
                       COEF * (teacher.double() - batch.rollout_log_probs.double()), 0.0)
    assert handed.token_rewards is not None
    torch.testing.assert_close(handed.token_rewards.double(),
                               batch.placed_rewards() + term, rtol=0, atol=1e-6)
    outside = handed.loss_mask == 0  # the observation tokens and the prompt: untouched
    assert torch.equal(handed.token_rewards[outside], batch.placed_rewards()[outside].float())


def test_the_default_placement_is_the_teachers_advantage_on_top() -> None:
    assert TeacherConfig(model="tiny").placement == "advantage"
    batch, teacher, values, _ = _case(3)
    _, out = _through_production("advantage", 3)
    estimator = build_estimator(AdvantageConfig(type="gae", gamma=GAMMA, lam=LAM))
    before = Distill(COEF).apply(batch, teacher_log_probs=teacher)  # what the manager did
    want = estimator.apply(before, values=values)
    assert torch.equal(out.advantages, want.advantages)


@pytest.mark.parametrize("kind", ["grpo", "reinforce_pp", "reward"])
def test_the_teacher_in_the_reward_needs_gae(kind: str) -> None:
    teacher = {"model": "tiny", "placement": "reward"}
    with pytest.raises(ValueError, match=f"teacher.placement: reward .* not {kind}"):
        RolloutConfig.model_validate({"advantage": {"type": kind}, "teacher": teacher})
    RolloutConfig.model_validate({"advantage": {"type": "gae"}, "teacher": teacher})
