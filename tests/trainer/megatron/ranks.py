"""Megatron trainer ranks as plain gloo processes (no Ray): each process builds a
``MegatronWorker`` and joins the process group through its own ``setup``."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed import free_port
from trainer.config import AggregationConfig, ObjectiveConfig, TrainerConfig

MAX_RESPONSE_LEN = 8


def objective_for(config: TrainerConfig, temperature: float = 1.0) -> ObjectiveConfig:
    """The default (sample_mean) objective of ``config`` at ``temperature``."""
    return ObjectiveConfig.compose(AggregationConfig(), config.loss, MAX_RESPONSE_LEN,
                                   temperature)


def start_worker(config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 rank: int, port: int, total_steps: int = 4) -> Any:
    """A set-up Megatron rank (call once per process, on every rank)."""
    from trainer.backends.megatron.worker import MegatronWorker

    worker = MegatronWorker(config, objective, model_path, rank, total_steps)
    worker.setup("127.0.0.1", port)
    return worker


def _rank(rank: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    from megatron.core import parallel_state as ps

    try:
        torch.save(fn(rank, port, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Spawn ``world_size`` processes running fn(rank, port, *args) (``port`` is the
    rendezvous port for ``start_worker``); return what each returned."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(free_port(), out_dir, fn, args), nprocs=world_size)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]
