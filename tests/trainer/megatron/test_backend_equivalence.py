"""Real Ray actors and gloo process groups on CPU: for the same batch and initial weights,
one optimizer step of the Megatron backend equals one step of the torch backend (losses
and updated weights converted back to HF names), for every aggregation mode; Megatron at
TP=2 and at DP=2 equals Megatron at TP=1.

SGD without clipping, so a wrong gradient scale (the SUM factor) shows in the weights;
several micro-batches per rank, so Megatron's division by their number is exercised."""

from __future__ import annotations

import pytest

from rollout.tiny import create_tiny_checkpoint
from tests.trainer.helpers import random_train_batch
from trainer.config import AGGREGATION_MODES, LossConfig, OptimizerConfig, TrainerConfig
from trainer.verify import Layout, StepResult, max_relative_difference, run_layout

pytest.importorskip("megatron.core")

TERMS = ("pg_loss", "kl", "entropy", "grad_norm", "clip_fraction", "valid_tokens",
         "mismatch/log_prob_abs_diff", *(f"pg_loss/{m}" for m in AGGREGATION_MODES))
MAX_RESPONSE_LEN = 8


class Runs:
    """One optimizer step per mode for a named layout, run once per module."""

    def __init__(self, model_path: str) -> None:
        self.model_path, self.results = model_path, {}
        self.batch = random_train_batch(100, num_prompts=3, group_size=2)
        self.config = TrainerConfig(
            optimizer=OptimizerConfig(type="sgd", lr=1.0, grad_clip=None),
            loss=LossConfig(kl_coef=0.1, entropy_coef=0.01, old_log_probs="rollout"),
            max_tokens_per_micro_batch=20,
        )

    def __call__(self, backend: str, dp_size: int = 1, tp_size: int = 1
                 ) -> dict[str, StepResult]:
        key = (backend, dp_size, tp_size)
        if key not in self.results:
            config = self.config.model_copy(update={"backend": backend, "tp_size": tp_size})
            self.results[key] = run_layout(config, self.model_path, self.batch,
                                           Layout(dp_size, 1), AGGREGATION_MODES,
                                           MAX_RESPONSE_LEN)
        return self.results[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0))


def assert_same_step(got: dict[str, StepResult], ref: dict[str, StepResult],
                     tolerance: float) -> None:
    for mode in AGGREGATION_MODES:
        assert set(got[mode].weights) == set(ref[mode].weights)
        assert max_relative_difference(got[mode].weights, ref[mode].weights) < tolerance, mode
        for term in TERMS:
            a, b = got[mode].metrics[term], ref[mode].metrics[term]
            assert abs(a - b) <= tolerance * max(abs(b), 1e-3), (mode, term, a, b)
    assert ref["sample_mean"].metrics["valid_tokens"] > 0


def test_megatron_step_equals_torch_step_for_every_mode(ray_cluster: None, runs: Runs) -> None:
    assert_same_step(runs("megatron"), runs("fsdp"), tolerance=1e-4)


def test_megatron_tp2_equals_tp1(ray_cluster: None, runs: Runs) -> None:
    assert_same_step(runs("megatron", tp_size=2), runs("megatron"), tolerance=1e-5)


def test_megatron_dp2_equals_dp1(ray_cluster: None, runs: Runs) -> None:
    assert_same_step(runs("megatron", dp_size=2), runs("megatron"), tolerance=1e-5)
