"""A rank plans a train step itself (``TrainerWorker.plan``): the plan the group would
make (``TrainerGroup.plan``), for every layout, so only the batch travels to the ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.trainer.helpers import random_train_batch
from trainer.backends.megatron import MegatronAttention
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig, TrainerConfig
from trainer.step_plan import StepPlan, packs, plan_step


def _same(a: StepPlan, b: StepPlan) -> None:
    for f in dataclasses.fields(StepPlan):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f.name
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize(("packing", "shared_prefix", "dp_size"),
                         [(True, True, 2), (True, False, 3), (False, False, 2)])
def test_an_fsdp_rank_plans_what_the_group_would(packing: bool, shared_prefix: bool,
                                                 dp_size: int) -> None:
    from trainer.backends.fsdp.worker import FSDPWorker

    batch = random_train_batch(64, num_prompts=6, group_size=4, seed=2)
    config = TrainerConfig(dp_size=dp_size, packing=packing, shared_prefix=shared_prefix,
                           max_tokens_per_micro_batch=40)
    objective = ObjectiveConfig.compose(AggregationConfig(mode="prompt_mean"), LossConfig(),
                                        8, 1.0)
    rank = FSDPWorker(config, objective, "unused", 1, total_steps=1)  # no setup: no model
    group = plan_step(batch, objective, dp_size, 1, 40, packed=packs(config),
                      shared_prefix=config.shares_prefix)
    _same(rank.plan(batch), group)
    other = ObjectiveConfig.compose(AggregationConfig(mode="token_mean"), LossConfig(), 8, 1.0)
    _same(rank.plan(batch, other), plan_step(batch, other, dp_size, 1, 40,
                                             packed=packs(config),
                                             shared_prefix=config.shares_prefix))


def test_a_megatron_rank_packs_as_the_drivers_attention_decision_says() -> None:
    from trainer.backends.megatron.worker import MegatronWorker

    config = TrainerConfig(backend="megatron")
    for packed in (True, False):
        rank = MegatronWorker(config, ObjectiveConfig(), "unused", 0, 1,
                              attention=MegatronAttention(transformer_engine=packed,
                                                          packed=packed))
        assert rank.packs_rows() is packed
    off = MegatronWorker(config.model_copy(update={"packing": False}), ObjectiveConfig(),
                         "unused", 0, 1, attention=MegatronAttention(True, True))
    assert off.packs_rows() is False
