"""Shared by the Megatron tests: a trainer rank in a plain gloo process
(``tests.distributed.run_ranks``, no Ray; the worker joins the process group through its
own ``setup``), the default objective, and how far apart two state dicts are."""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import AggregationConfig, ObjectiveConfig, TrainerConfig

MAX_RESPONSE_LEN = 10


def objective_for(config: TrainerConfig, temperature: float = 1.0) -> ObjectiveConfig:
    """The default (sample_mean) objective of ``config`` at ``temperature``."""
    return ObjectiveConfig.compose(AggregationConfig(), config.loss, MAX_RESPONSE_LEN,
                                   temperature)


def start_worker(config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 rank: int, port: int, total_steps: int = 4) -> Any:
    """A set-up Megatron rank (once per process, on every rank at the same time)."""
    from trainer.backends.megatron.worker import MegatronWorker

    worker = MegatronWorker(config, objective, model_path, rank, total_steps)
    worker.setup("127.0.0.1", port)
    return worker


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ‖a − b‖∞ / max(‖b‖∞, tiny)."""
    return max(float((a[k].double() - b[k].double()).abs().max()
                     / b[k].double().abs().max().clamp(min=1e-30)) for k in b)
