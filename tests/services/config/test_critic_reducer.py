"""The critic's reducer is its own setting (``critic.custom_reducer``): it reaches the
critic's objective, the policy's ``aggregation.custom_reducer`` never does, and a bad
path is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config.errors import ConfigError
from services.config.job import load_job_config

PPO = Path(__file__).resolve().parents[3] / "configs" / "demo-ppo.yaml"
REDUCER = "tests.trainer.reducers:discounted_group_mean"
OTHER = "tests.trainer.reducers:other_reducer"  # validated as a path; imported by preflight


@pytest.mark.parametrize("critic_mode", [None, "prompt_mean"])
def test_the_critic_takes_its_own_reducer_and_never_the_policys(critic_mode: str | None
                                                                ) -> None:
    mode = [f"critic.aggregation={critic_mode}"] if critic_mode else []
    job = load_job_config(PPO, [f"aggregation.custom_reducer={REDUCER}",
                                f"critic.custom_reducer={OTHER}", *mode])
    assert job.objective_config().pg.custom_reducer == REDUCER
    critic = job.critic_objective_config()
    assert critic.pg.custom_reducer == OTHER
    assert critic.pg.mode == (critic_mode or job.aggregation.mode)
    alone = load_job_config(PPO, [f"aggregation.custom_reducer={REDUCER}", *mode])
    assert alone.critic_objective_config().pg.custom_reducer is None


def test_a_bad_critic_reducer_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"critic: custom_reducer: expected 'module:function'"):
        load_job_config(PPO, ["critic.custom_reducer=not-a-path"])


def test_warmup_until_explained_variance_is_at_most_one() -> None:
    assert load_job_config(PPO, ["critic.warmup_until_explained_variance=0.3"]
                           ).critic.warmup_until_explained_variance == 0.3
    with pytest.raises(ConfigError, match=r"critic\.warmup_until_explained_variance"):
        load_job_config(PPO, ["critic.warmup_until_explained_variance=1.5"])


def test_the_critics_reducer_weighs_its_value_loss() -> None:
    import torch

    from tests.trainer.helpers import random_train_batch
    from trainer.aggregation import custom_reducer_weights
    from trainer.step_plan import plan_step

    job = load_job_config(PPO, [f"critic.custom_reducer={REDUCER}"])
    batch = random_train_batch(vocab_size=50)
    plan = plan_step(batch, job.critic_objective_config(), dp_size=1, cp_size=1,
                     max_tokens_per_micro_batch=64)
    want = custom_reducer_weights(REDUCER, batch.loss_mask, batch.group_index)
    assert torch.equal(plan.dense_weights["value"], want)
