"""Shared by the backend-equivalence tests: run a trainer layout once (real Ray actors,
gloo on CPU) and compare two layouts' gradients, metrics and updated weights.

A run computes the full gradients at the initial weights (the ``gradients`` verb, no
update), then one optimizer step per aggregation mode from those weights, and exports
the updated weights with HF names, so any two backends or layouts compare name by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch

from rollout.batch import RolloutBatch
from tests.trainer.megatron.helpers import MAX_RESPONSE_LEN, max_relative_difference
from trainer.config import (
    AGGREGATION_MODES,
    AggregationConfig,
    LossConfig,
    ObjectiveConfig,
    TrainerConfig,
)
from trainer.group import TrainerGroup

TERMS = ("pg_loss", "kl", "entropy", "grad_norm", "clip_fraction", "valid_tokens",
         "mismatch/log_prob_abs_diff", *(f"pg_loss/{m}" for m in AGGREGATION_MODES))


@dataclass(frozen=True)
class StepResult:
    metrics: dict[str, float]
    weights: dict[str, torch.Tensor]


RunResult = tuple[dict[str, torch.Tensor], dict[str, StepResult]]
"""(full gradients at the initial weights, {mode: one step from the initial weights})."""


def objective_of(mode: str, loss: LossConfig) -> ObjectiveConfig:
    divisor = "max_response_len" if mode == "constant" else None
    return ObjectiveConfig.compose(AggregationConfig(mode=mode, divisor=divisor), loss,
                                   MAX_RESPONSE_LEN, temperature=1.0)


class Runs:
    """For a named layout (backend, dp_size, tp_size), run once and keep the result."""

    def __init__(self, model_path: str, batch: RolloutBatch, config: TrainerConfig,
                 modes: tuple[str, ...] = AGGREGATION_MODES) -> None:
        self.model_path, self.batch, self.config, self.modes = model_path, batch, config, modes
        self.results: dict[tuple[str, int, int], RunResult] = {}

    def __call__(self, backend: str, dp_size: int = 1, tp_size: int = 1) -> RunResult:
        key = (backend, dp_size, tp_size)
        if key not in self.results:
            config = self.config.model_copy(update={"backend": backend, "dp_size": dp_size,
                                                    "tp_size": tp_size})
            self.results[key] = self._run(config)
        return self.results[key]

    def _run(self, config: TrainerConfig) -> RunResult:
        group = TrainerGroup(config, objective_of("sample_mean", config.loss),
                             self.model_path, total_steps=1)
        try:
            initial = group.async_export_weights()
            (_, grads), = group.gradients(self.batch, [group.objective])
            steps = {}
            for mode in self.modes:
                group.load_weights(initial)
                metrics = group.train(self.batch, objective=objective_of(mode, config.loss))
                steps[mode] = StepResult(metrics, ray.get(group.async_export_weights()))
            return grads, steps
        finally:
            group.shutdown()


def assert_same(got: RunResult, ref: RunResult, tolerance: float) -> float:
    """Gradients and updated weights within ``tolerance`` relative to ``ref`` (per tensor,
    max-norm), every logged term within ``tolerance`` relative (absolute below 1e-3).
    Returns the largest relative difference of the tensors, for reports."""
    (got_grads, got_steps), (ref_grads, ref_steps) = got, ref
    assert set(got_grads) == set(ref_grads)
    worst = max_relative_difference(got_grads, ref_grads)
    assert worst < tolerance, ("gradients", worst)
    assert set(got_steps) == set(ref_steps)
    for mode, ref_step in ref_steps.items():
        got_step = got_steps[mode]
        assert set(got_step.weights) == set(ref_step.weights)
        difference = max_relative_difference(got_step.weights, ref_step.weights)
        assert difference < tolerance, (mode, difference)
        worst = max(worst, difference)
        for term in TERMS:
            a, b = got_step.metrics[term], ref_step.metrics[term]
            assert abs(a - b) <= tolerance * max(abs(b), 1e-3), (mode, term, a, b)
        assert ref_step.metrics["valid_tokens"] > 0
    return worst
