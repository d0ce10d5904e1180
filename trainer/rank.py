"""What every trainer rank does the same way, whatever its backend, as plain functions:
join the process group through rank 0's store (bounded timeout, so a rank waiting on a
dead peer gives up), pick its compute and parameter dtypes, and carry its scheduler and
RNG state through a checkpoint. The verbs themselves are ``trainer/worker.py``'s."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.config import TrainerConfig


def compute_dtype(config: TrainerConfig, device: torch.device) -> torch.dtype:
    """``trainer.dtype``: auto is bf16 on GPU and fp32 on CPU (parameters stay fp32)."""
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)


def master_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the weights the optimizer steps (FSDP's parameters, Megatron's main
    params): fp32, or fp64 when computing in fp64 (for verification)."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def open_store(config: TrainerConfig, rank: int, host: str, port: int) -> dist.TCPStore:
    """The rendezvous store: rank 0 hosts it on ``port`` (0: one the OS picks, bound and
    kept, so nothing else on the node can take it in between); the others connect."""
    return dist.TCPStore(host, port, config.world_size, is_master=rank == 0,
                         timeout=timedelta(seconds=config.collective_timeout_s),
                         wait_for_workers=False)


def process_group_backend(device_type: str) -> str:
    """The world group's backend, the one place it is chosen. On GPU both devices are
    served: NCCL for CUDA tensors, gloo for the CPU tensors the workers also reduce (the
    step's logged sums, rank 0's gathered log-probs, checkpoint metadata). Plain "nccl"
    serves CUDA tensors only: a CPU all-reduce on it raises "No backend type associated
    with device type cpu" at the first step."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def init_rank(config: TrainerConfig, rank: int, store: dist.Store) -> torch.device:
    """Threads, device and the world process group (:func:`process_group_backend`);
    every subgroup made from it (DeviceMesh, Megatron's) inherits that backend."""
    torch.set_num_threads(config.num_threads or 1)  # the driver resolves None per phase
    cuda = config.num_gpus_per_rank > 0 and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group(
        process_group_backend(device.type), store=store, rank=rank,
        world_size=config.world_size, timeout=timedelta(seconds=config.collective_timeout_s))
    return device
