"""Real Ray actors and gloo process groups on CPU: for the same batch and initial weights,
one optimizer step of the Megatron backend equals one step of the torch backend (losses
and updated weights converted back to HF names), for every aggregation mode; Megatron at
TP=2 and at DP=2 equals Megatron at TP=1. The ``gradients`` verb (no update) returns the
same HF-named full gradients on both backends.

SGD without clipping, so a wrong gradient scale (the SUM factor) shows in the weights;
several micro-batches per rank, so Megatron's division by their number is exercised."""

from __future__ import annotations

import pytest

from rollout.tiny import create_tiny_checkpoint
from tests.trainer.helpers import random_train_batch
from tests.trainer.megatron.equivalence import Runs, assert_same
from trainer.config import LossConfig, OptimizerConfig, TrainerConfig

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    config = TrainerConfig(
        optimizer=OptimizerConfig(type="sgd", lr=1.0, grad_clip=None),
        loss=LossConfig(kl_coef=0.1, entropy_coef=0.01, old_log_probs="rollout"),
        max_tokens_per_micro_batch=20,
    )
    return Runs(create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0),
                random_train_batch(100, num_prompts=3, group_size=2), config)


def test_megatron_step_equals_torch_step_for_every_mode(ray_cluster: None, runs: Runs) -> None:
    assert_same(runs("megatron"), runs("fsdp"), tolerance=1e-4)


def test_megatron_tp2_equals_tp1(ray_cluster: None, runs: Runs) -> None:
    assert_same(runs("megatron", tp_size=2), runs("megatron"), tolerance=1e-5)


def test_megatron_dp2_equals_dp1(ray_cluster: None, runs: Runs) -> None:
    assert_same(runs("megatron", dp_size=2), runs("megatron"), tolerance=1e-5)
