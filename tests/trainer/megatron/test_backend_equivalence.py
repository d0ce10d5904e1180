"""Real Ray actors and gloo process groups on CPU: for the same batch and initial weights,
one optimizer step of the Megatron backend equals one step of the torch backend (losses
and updated weights converted back to HF names), for every aggregation mode; Megatron at
TP=2 and at DP=2 equals Megatron at TP=1. The ``gradients`` verb (no update) returns the
same HF-named full gradients on both backends.

SGD without clipping, so a wrong gradient scale (the SUM factor) shows in the weights;
several micro-batches per rank, so Megatron's division by their number is exercised."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import ray
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.trainer.helpers import random_train_batch
from tests.trainer.megatron.helpers import MAX_RESPONSE_LEN, max_relative_difference
from trainer.config import (
    AGGREGATION_MODES,
    AggregationConfig,
    LossConfig,
    ObjectiveConfig,
    OptimizerConfig,
    TrainerConfig,
)
from trainer.group import TrainerGroup

pytest.importorskip("megatron.core")

TERMS = ("pg_loss", "kl", "entropy", "grad_norm", "clip_fraction", "valid_tokens",
         "mismatch/log_prob_abs_diff", *(f"pg_loss/{m}" for m in AGGREGATION_MODES))


@dataclass(frozen=True)
class StepResult:
    metrics: dict[str, float]
    weights: dict[str, torch.Tensor]


def objective_of(mode: str, loss: LossConfig) -> ObjectiveConfig:
    divisor = "max_response_len" if mode == "constant" else None
    return ObjectiveConfig.compose(AggregationConfig(mode=mode, divisor=divisor), loss,
                                   MAX_RESPONSE_LEN, temperature=1.0)


class Runs:
    """For a named layout, run once per module: the gradients at the initial weights,
    then one optimizer step per mode from those weights."""

    def __init__(self, model_path: str) -> None:
        self.model_path, self.results = model_path, {}
        self.batch = random_train_batch(100, num_prompts=3, group_size=2)
        self.config = TrainerConfig(
            optimizer=OptimizerConfig(type="sgd", lr=1.0, grad_clip=None),
            loss=LossConfig(kl_coef=0.1, entropy_coef=0.01, old_log_probs="rollout"),
            max_tokens_per_micro_batch=20,
        )

    def __call__(self, backend: str, dp_size: int = 1, tp_size: int = 1
                 ) -> tuple[dict[str, torch.Tensor], dict[str, StepResult]]:
        key = (backend, dp_size, tp_size)
        if key not in self.results:
            config = self.config.model_copy(update={"backend": backend, "dp_size": dp_size,
                                                    "tp_size": tp_size})
            self.results[key] = self._run(config)
        return self.results[key]

    def _run(self, config: TrainerConfig
             ) -> tuple[dict[str, torch.Tensor], dict[str, StepResult]]:
        group = TrainerGroup(config, objective_of("sample_mean", config.loss),
                             self.model_path, total_steps=1)
        try:
            initial = group.async_export_weights()
            (_, grads), = group.gradients(self.batch, [group.objective])
            steps = {}
            for mode in AGGREGATION_MODES:
                group.load_weights(initial)
                metrics = group.train(self.batch, objective=objective_of(mode, config.loss))
                steps[mode] = StepResult(metrics, ray.get(group.async_export_weights()))
            return grads, steps
        finally:
            group.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0))


def assert_same(got: tuple[dict, dict[str, StepResult]],
                ref: tuple[dict, dict[str, StepResult]], tolerance: float) -> None:
    (got_grads, got_steps), (ref_grads, ref_steps) = got, ref
    assert set(got_grads) == set(ref_grads)
    assert max_relative_difference(got_grads, ref_grads) < tolerance
    for mode in AGGREGATION_MODES:
        got_step, ref_step = got_steps[mode], ref_steps[mode]
        assert set(got_step.weights) == set(ref_step.weights)
        assert max_relative_difference(got_step.weights, ref_step.weights) < tolerance, mode
        for term in TERMS:
            a, b = got_step.metrics[term], ref_step.metrics[term]
            assert abs(a - b) <= tolerance * max(abs(b), 1e-3), (mode, term, a, b)
    assert ref_steps["sample_mean"].metrics["valid_tokens"] > 0


def test_megatron_step_equals_torch_step_for_every_mode(ray_cluster: None, runs: Runs) -> None:
    assert_same(runs("megatron"), runs("fsdp"), tolerance=1e-4)


def test_megatron_tp2_equals_tp1(ray_cluster: None, runs: Runs) -> None:
    assert_same(runs("megatron", tp_size=2), runs("megatron"), tolerance=1e-5)


def test_megatron_dp2_equals_dp1(ray_cluster: None, runs: Runs) -> None:
    assert_same(runs("megatron", dp_size=2), runs("megatron"), tolerance=1e-5)
