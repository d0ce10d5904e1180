"""Check that parallel layouts agree: one optimizer step on the same batch under each
layout, compared with the first. Users run it (``tally verify-aggregation``) to trust a
new parallel setup; the tests run it too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.batch import TrainBatch
from trainer.config import AGGREGATION_MODES, AggregationConfig, TrainerConfig
from trainer.group import TrainerGroup

LOGGED_TERMS = ("pg_loss", "kl", "entropy", "grad_norm")


@dataclass(frozen=True)
class Layout:
    dp_size: int
    cp_size: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'dp2cp1' -> Layout(2, 1)."""
        try:
            dp, cp = text.lower().removeprefix("dp").split("cp")
            return cls(int(dp), int(cp))
        except ValueError as err:
            raise ValueError(f"layouts: expected entries like 'dp2cp1', got {text!r}") from err

    def __str__(self) -> str:
        return f"dp{self.dp_size}cp{self.cp_size}"


@dataclass(frozen=True)
class StepResult:
    metrics: dict[str, float]
    weights: dict[str, torch.Tensor]


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ‖a − b‖∞ / max(‖b‖∞, tiny)."""
    return max(
        float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp(
            min=1e-30))
        for k in b
    )


def run_layout(config: TrainerConfig, model_path: str, batch: TrainBatch, layout: Layout,
               modes: tuple[str, ...], max_response_len: int | None) -> dict[str, StepResult]:
    """One optimizer step per mode, each from the same initial weights."""
    config = config.model_copy(update={"dp_size": layout.dp_size, "cp_size": layout.cp_size})
    group = TrainerGroup(config, model_path, total_steps=1, max_response_len=max_response_len)
    try:
        initial = group.async_export_weights()
        results = {}
        for mode in modes:
            group.load_weights(initial)
            divisor = "max_response_len" if mode == "constant" else None
            loss = config.loss.model_copy(
                update={"aggregation": AggregationConfig(mode=mode, divisor=divisor)})
            metrics = group.train(batch, loss)
            import ray

            results[mode] = StepResult(metrics, ray.get(group.async_export_weights()))
        return results
    finally:
        group.shutdown()


def verify_layouts(config: TrainerConfig, model_path: str, batch: TrainBatch,
                   layouts: list[Layout], max_response_len: int | None,
                   modes: tuple[str, ...] = AGGREGATION_MODES) -> list[dict[str, object]]:
    """Rows of (layout, mode, weight diff, per-term loss diffs) against the first layout."""
    reference = run_layout(config, model_path, batch, layouts[0], modes, max_response_len)
    rows = []
    for layout in layouts:
        results = (reference if layout == layouts[0] else
                   run_layout(config, model_path, batch, layout, modes, max_response_len))
        for mode in modes:
            ref, got = reference[mode], results[mode]
            row: dict[str, object] = {"layout": str(layout), "mode": mode,
                                      "weights": max_relative_difference(got.weights, ref.weights)}
            for term in LOGGED_TERMS:
                denominator = max(abs(ref.metrics[term]), 1e-30)
                row[term] = abs(got.metrics[term] - ref.metrics[term]) / denominator
            rows.append(row)
    return rows
