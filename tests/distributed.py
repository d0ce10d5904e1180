"""Run a function on real torch.distributed (gloo) processes and collect what each returns.

Rendezvous without a port race: rank 0 hosts the TCPStore on port 0 (the OS picks the
port, and rank 0 holds it from then on) and hands the number to the other ranks through a
queue. No port is ever probed free and bound again later, when another process on the
machine may have taken it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_timeout

START_METHOD = "forkserver"
"""Ranks are forked from one server process per pytest worker that imported torch and
the trainers once (``PRELOAD``), instead of each rank spawning a fresh interpreter that
imports them again (2.5–4 CPU-s a rank): a gloo test module runs about 3× faster here.
Each rank is still its own process with its own process group; what a test sets in
``os.environ`` after the server started does not reach its ranks (none does)."""
PRELOAD = ["torch", "torch.distributed", "transformers", "trainer.backends.fsdp.worker",
           "trainer.backends.megatron.worker"]


def _context() -> Any:
    ctx = mp.get_context(START_METHOD)
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


PORT_WAIT_S = 600.0
"""How long a rank waits for rank 0's port (a guard: start_processes ends the others when
rank 0 fails)."""


def _publish(ports: Any, port: int, world_size: int) -> None:
    for _ in range(world_size - 1):
        ports.put(port)


def _store(rank: int, world_size: int, ports: Any) -> dist.TCPStore:
    """Rank 0 hosts the store on a port the OS picks and publishes it; the others join."""
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                              timeout=default_pg_timeout, wait_for_workers=False)
        _publish(ports, store.port, world_size)
        return store
    return dist.TCPStore("127.0.0.1", ports.get(timeout=PORT_WAIT_S), world_size,
                         is_master=False, timeout=default_pg_timeout)


def _worker(rank: int, world_size: int, ports: Any, out_dir: str, fn: Callable[..., Any],
            args: tuple) -> None:
    dist.init_process_group("gloo", store=_store(rank, world_size, ports), rank=rank,
                            world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Spawn world_size processes running fn(rank, world_size, *args) in one gloo process
    group; return their results."""
    ports = _context().Queue()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, ports, out_dir, fn, args),
                           nprocs=world_size, start_method=START_METHOD)
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]


def _publish_rank0_store(ports: Any, world_size: int) -> None:
    """Have the trainer's own ``open_store`` tell the other ranks the port of the store
    rank 0 opens (on port 0: ``trainer.rank.open_store`` lets the OS pick it)."""
    import trainer.rank
    import trainer.worker

    opened = trainer.rank.open_store

    def open_and_publish(config: Any, rank: int, host: str, port: int) -> dist.TCPStore:
        store = opened(config, rank, host, port)
        if rank == 0:
            _publish(ports, store.port, world_size)
        return store

    trainer.rank.open_store = trainer.worker.open_store = open_and_publish


def _rank(rank: int, world_size: int, ports: Any, out_dir: str, fn: Callable[..., Any],
          args: tuple) -> None:
    if rank == 0:
        _publish_rank0_store(ports, world_size)
        port = 0
    else:
        port = ports.get(timeout=PORT_WAIT_S)
    torch.save(fn(rank, port, *args), Path(out_dir) / f"rank{rank}.pt")
    if dist.is_initialized():  # every rank is done before rank 0 takes the store down:
        dist.barrier()  # exiting with the group up aborted rank 0 once under load
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Spawn world_size processes running fn(rank, port, *args) that join the process
    group themselves (as a trainer rank's ``setup`` does) at 127.0.0.1:port: rank 0 gets
    port 0 and hosts the store where the OS puts it, the others get that port."""
    ports = _context().Queue()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(world_size, ports, out_dir, fn, args),
                           nprocs=world_size, start_method=START_METHOD)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]
