"""PPO's critic warm-up: the rule of services/driver/critic_warmup.py by cases, and the
driver's ``train_optimizer_steps`` (what production runs) with a policy whose optimizer
and LR schedule are real torch objects: the critic-only rollouts move neither, so the
policy's schedule counts its own steps from its warm-up to its floor."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollout.batch import RolloutBatch
from services.config.job import load_job_config
from services.driver.critic_warmup import WAITING, CriticWarmup
from services.driver.loop import train_optimizer_steps
from trainer.config import OptimizerConfig
from trainer.optim import build_scheduler, lr_factor, schedule_steps

PPO = Path(__file__).resolve().parents[3] / "configs" / "demo-ppo.yaml"


@pytest.mark.parametrize(("warmup_steps", "threshold", "evs", "expected"), [
    (3, None, [0.9, 0.9, 0.9, 0.0, 0.0], [0, 0, 0, 1, 1]),  # steps alone
    (0, None, [None, None], [1, 1]),  # no warm-up
    (0, 0.5, [0.1, 0.6, 0.2, 0.0], [0, 1, 1, 1]),  # waits for 0.5, then for good
    (0, 0.5, [None, 0.49, 0.5], [0, 0, 1]),  # reaching it counts; no value is not
    (2, 0.5, [0.1, 0.1, 0.1], [0, 0, 1]),  # warmup_steps bounds the wait
    (4, 0.5, [0.1, 0.7, 0.1, 0.1, 0.1], [0, 1, 1, 1, 1]),  # reached before the bound
])
def test_the_policy_waits_as_the_rule_says(warmup_steps: int, threshold: float | None,
                                           evs: list[float | None], expected: list[int]
                                           ) -> None:
    warmup = CriticWarmup(warmup_steps, threshold)
    assert [int(warmup.policy_trains(step, ev)) for step, ev in enumerate(evs)] == expected


def test_a_resumed_job_knows_the_policy_had_started() -> None:
    rows = [{WAITING: 1.0}, {WAITING: 1.0}, {WAITING: 0.0}]
    warmup = CriticWarmup(0, 0.9)
    warmup.restore(rows)
    assert warmup.policy_trains(3, explained_variance=-1.0)  # started before: for good
    waiting = CriticWarmup(0, 0.9)
    waiting.restore(rows[:2])
    assert not waiting.policy_trains(2, explained_variance=0.5)


class PolicyWithSchedule:
    """The policy group as the driver sees it, its step a real AdamW step and scheduler
    step (what FSDPRank.optimizer_step does), logging the lr it used."""

    def __init__(self, config: OptimizerConfig, total_steps: int) -> None:
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.optimizer = torch.optim.AdamW([self.weight], lr=config.lr)
        self.scheduler = build_scheduler(self.optimizer, config, total_steps)
        self.lrs: list[float] = []

    def train(self, mini: RolloutBatch, batch_ref: Any = None) -> dict[str, float]:
        lr = self.optimizer.param_groups[0]["lr"]
        self.weight.grad = torch.ones(1)
        self.optimizer.step()
        self.scheduler.step()
        self.lrs.append(lr)
        return {"lr": lr}


def _rollout(ev: float) -> RolloutBatch:
    """Two groups of two, one token each; the rollout's explained variance."""
    return RolloutBatch.from_samples(
        prompt_ids=[[3]] * 4, response_ids=[[5]] * 4, response_log_probs=[[-1.0]] * 4,
        rewards=[1.0, 0.0, 1.0, 0.0], advantages=[1.0, -1.0, 1.0, -1.0],
        group_index=[0, 0, 1, 1], samples_per_prompt=2,
        metadata={"critic/explained_variance": ev})


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_critic_only_rollouts_move_neither_the_policy_nor_its_schedule(
        threshold: float | None) -> None:
    config = load_job_config(PPO, [
        "num_steps=6", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.global_batch_size=2", "trainer.ppo_epochs=1", "critic.warmup_steps=2",
        "trainer.loss.old_log_probs=rollout"]
        + ([f"critic.warmup_until_explained_variance={threshold}"] if threshold else []))
    assert config.num_updates_per_rollout == 2
    optimizer = config.trainer.optimizer  # cosine, 2 warm-up steps, floor 0.1
    horizon = schedule_steps(config.num_steps, config.num_updates_per_rollout,
                             config.critic.warmup_steps)
    policy = PolicyWithSchedule(optimizer, horizon)
    critic_steps: list[int] = []
    written: list[dict[str, float]] = []
    job = SimpleNamespace(
        config=config, warmup=CriticWarmup(config.critic.warmup_steps,
                                           config.critic.warmup_until_explained_variance),
        actors=SimpleNamespace(trainer=policy, critic=SimpleNamespace(
            start_train=lambda mini: (critic_steps.append(1),
                                      lambda: {"value_loss": 0.5})[1])),
        updates=SimpleNamespace(write=lambda step, row: written.append(row)))
    evs = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]  # the threshold is not reached before the bound
    for step, ev in enumerate(evs):
        train_optimizer_steps(job, step, _rollout(ev), None)
    assert len(critic_steps) == 12  # the critic steps on every rollout
    assert [row[WAITING] for row in written] == [1.0] * 4 + [0.0] * 8
    assert all("lr" not in row for row in written[:4])  # the policy sat them out
    # The policy's 8 steps are its schedule's steps 0..7: warm-up from its first step,
    # the cosine over the 8 steps it takes (not the job's 12), its last at the floor's edge.
    assert policy.scheduler.last_epoch == 8 == horizon
    expected = [optimizer.lr * lr_factor(s, optimizer, horizon) for s in range(8)]
    assert policy.lrs == pytest.approx(expected, rel=1e-12)
    assert policy.lrs[0] == pytest.approx(optimizer.lr / optimizer.warmup_steps)
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(
        optimizer.lr * optimizer.min_lr_ratio)  # after its last step: the floor
