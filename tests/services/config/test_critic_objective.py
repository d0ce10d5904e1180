"""The critic's objective as the job derives it (services/config/job.py): the job's
aggregation mode or ``critic.aggregation``, never the policy's ``custom_reducer`` (which
weighs the pg term only), and the value term planned with weights of its own."""

from __future__ import annotations

from pathlib import Path

import torch

from services.config.job import load_job_config
from tests.trainer.helpers import random_train_batch
from trainer.step_plan import plan_step

PPO = Path(__file__).resolve().parents[3] / "configs" / "demo-ppo.yaml"
REDUCER = "tests.trainer.reducers:discounted_group_mean"


def test_the_critic_never_inherits_the_policys_custom_reducer() -> None:
    job = load_job_config(PPO, [f"aggregation.custom_reducer={REDUCER}",
                                "aggregation.mode=token_mean"])
    assert job.objective_config().pg.custom_reducer == REDUCER  # the policy keeps it
    critic = job.critic_objective_config()
    assert critic.pg.custom_reducer is None and critic.pg.mode == "token_mean"
    batch = random_train_batch(vocab_size=50)
    plan = plan_step(batch, critic, dp_size=1, cp_size=1, max_tokens_per_micro_batch=64)
    assert plan.dense_weights == {}  # the reducer's dense weights went nowhere near it
    plain = load_job_config(PPO, ["aggregation.mode=token_mean"]).critic_objective_config()
    same = plan_step(batch, plain, dp_size=1, cp_size=1, max_tokens_per_micro_batch=64)
    assert torch.equal(plan.coefficients["value"], same.coefficients["value"])
    own = load_job_config(PPO, [f"aggregation.custom_reducer={REDUCER}",
                                "critic.aggregation=prompt_mean"]).critic_objective_config()
    assert own.pg.custom_reducer is None and own.pg.mode == "prompt_mean"
