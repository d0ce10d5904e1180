"""Real Ray actors and gloo process groups on CPU: for the same batch and initial weights,
one optimizer step of the Megatron backend equals one step of the torch backend (losses
and updated weights converted back to HF names), for every aggregation mode; Megatron at
TP=2 and at DP=2 equals Megatron at TP=1. The ``gradients`` verb (no update) returns the
same HF-named full gradients on both backends.

SGD without clipping, so a wrong gradient scale (the SUM factor) shows in the weights;
several micro-batches per rank, so Megatron's division by their number is exercised, and
``assert_same`` is shown failing when that factor is planted wrong. The tiny model's
vocabulary spans both TP ranks (``helpers.WIDE_VOCAB``)."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import random_train_batch
from tests.trainer.megatron.equivalence import Runs, assert_same, objective_of
from tests.trainer.megatron.helpers import (
    WIDE_VOCAB,
    create_wide_vocab_checkpoint,
    max_relative_difference,
)
from trainer.config import LossConfig, OptimizerConfig, TrainerConfig
from trainer.step_plan import plan_step

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    config = TrainerConfig(
        optimizer=OptimizerConfig(type="sgd", lr=1.0, grad_clip=None),
        loss=LossConfig(kl_coef=0.1, entropy_coef=0.01, old_log_probs="rollout"),
        max_tokens_per_micro_batch=20,
    )
    return Runs(create_wide_vocab_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0),
                random_train_batch(WIDE_VOCAB, num_prompts=3, group_size=2), config)


@pytest.mark.slow
def test_megatron_step_equals_torch_step_for_every_mode(ray_cluster: None, runs: Runs) -> None:
    assert_same(runs("megatron"), runs("fsdp"), tolerance=1e-4)


@pytest.mark.slow
def test_megatron_tp2_equals_tp1(ray_cluster: None, runs: Runs) -> None:
    assert_same(runs("megatron", tp_size=2), runs("megatron"), tolerance=1e-5)


@pytest.mark.slow
def test_megatron_dp2_equals_dp1(ray_cluster: None, runs: Runs) -> None:
    assert_same(runs("megatron", dp_size=2), runs("megatron"), tolerance=1e-5)


@pytest.mark.slow
def test_assert_same_fails_on_a_wrong_sum_factor(ray_cluster: None, runs: Runs,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's division by the number of micro-batches K left in (the SUM factor dp
    instead of dp·K): the gradients are exactly ∇J / K, and assert_same refuses them."""
    from trainer import group

    plan = plan_step(runs.batch, objective_of("sample_mean", runs.config.loss), 1, 1,
                     runs.config.max_tokens_per_micro_batch, packed=False)
    num_micro_batches = len(plan.micro_batches[0])
    assert num_micro_batches > 1  # else the planted factor would be the right one
    monkeypatch.setitem(group.WORKER_CLASSES, "megatron",
                        "tests.trainer.megatron.wrong_factor:MissingMicroBatchFactorWorker")
    wrong = Runs(runs.model_path, runs.batch, runs.config)("megatron")
    right = runs("megatron")
    scaled = {name: grad * num_micro_batches for name, grad in wrong[0].items()}
    assert max_relative_difference(scaled, right[0]) < 1e-5  # exactly the planted 1/K
    with pytest.raises(AssertionError, match="gradients"):
        assert_same(wrong, right, tolerance=1e-5)
    for mode, step in right[1].items():  # and the updated weights are off too
        assert max_relative_difference(wrong[1][mode].weights, step.weights) > 1e-5, mode
