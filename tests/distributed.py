"""Run a function on real torch.distributed (gloo) processes and collect what each returns."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Spawn world_size processes running fn(rank, world_size, *args); return their results."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size)
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]


def _rank(rank: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.save(fn(rank, port, *args), Path(out_dir) / f"rank{rank}.pt")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Spawn world_size processes running fn(rank, port, *args) that join the process
    group themselves (as a trainer rank's ``setup`` does) at 127.0.0.1:port."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(free_port(), out_dir, fn, args), nprocs=world_size)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]
