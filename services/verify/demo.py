"""The aggregation demo: one random step split over DP=2 × CP=2 gloo processes.

Prints J under each mode as the distributed ranks compute it (Σ over ranks of their local
Σ w·ℓ, micro-batched, zigzag CP shards) next to the single-process reference.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.aggregation import AGGREGATION_MODES, aggregate, local_weighted_sum, token_weights
from trainer.context_parallel import zigzag_shard

NUM_PROMPTS, GROUP_SIZE, MAX_LEN, VOCAB = 4, 4, 24, 32
CONSTANT_DIVISOR = float(MAX_LEN)


def random_step(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, loss mask and group_index of a step with very uneven response lengths."""
    gen = torch.Generator().manual_seed(seed)
    num_samples = NUM_PROMPTS * GROUP_SIZE
    lengths = torch.randint(0, MAX_LEN + 1, (num_samples,), generator=gen)
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).to(torch.float64)
    tokens = torch.randint(0, VOCAB, (num_samples, MAX_LEN), generator=gen)
    groups = torch.arange(NUM_PROMPTS).repeat_interleave(GROUP_SIZE)
    return tokens, mask, groups


def token_losses(tokens: torch.Tensor) -> torch.Tensor:
    """A fixed per-token loss: −log p(token) under a seeded unigram model."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return -torch.log_softmax(logits, dim=0)[tokens]


def _rank_main(rank: int, world_size: int, cp_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    dp_size, dp_rank, cp_rank = world_size // cp_size, rank // cp_size, rank % cp_size
    tokens, mask, groups = random_step()
    owned = torch.arange(len(tokens)).tensor_split(dp_size)[dp_rank]
    values = {}
    for mode in AGGREGATION_MODES:
        divisor = CONSTANT_DIVISOR if mode == "constant" else None
        weights = token_weights(mask, groups, mode, divisor)
        local = torch.zeros((), dtype=torch.float64)
        for micro in owned.tensor_split(2):
            shard_tokens = zigzag_shard(tokens[micro], cp_size, cp_rank)
            shard_weights = zigzag_shard(weights[micro], cp_size, cp_rank)
            local += local_weighted_sum(token_losses(shard_tokens), shard_weights)
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        values[mode] = float(local)
    if rank == 0:
        torch.save(values, Path(out_dir) / "values.pt")
    dist.destroy_process_group()


def run_demo(dp_size: int = 2, cp_size: int = 2) -> dict[str, tuple[float, float]]:
    """(distributed J, reference J) per mode."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tokens, mask, groups = random_step()
    reference = {
        mode: float(aggregate(token_losses(tokens), mask, groups, mode,
                              CONSTANT_DIVISOR if mode == "constant" else None))
        for mode in AGGREGATION_MODES
    }
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(dp_size * cp_size, cp_size, port, out_dir),
                 nprocs=dp_size * cp_size)
        distributed = torch.load(Path(out_dir) / "values.pt")
    return {mode: (distributed[mode], reference[mode]) for mode in AGGREGATION_MODES}


def print_demo(dp_size: int = 2, cp_size: int = 2) -> bool:
    tokens, mask, _ = random_step()
    print(f"step: {len(tokens)} samples in {NUM_PROMPTS} groups of {GROUP_SIZE}, "
          f"response lengths {mask.sum(-1).to(torch.int64).tolist()}")
    print(f"layout: DP={dp_size} × CP={cp_size} gloo processes, 2 micro-batches per rank\n")
    print(f"{'mode':<12} {'distributed J':>16} {'reference J':>16} {'rel. diff':>10}")
    exact = True
    for mode, (distributed, reference) in run_demo(dp_size, cp_size).items():
        rel = abs(distributed - reference) / max(abs(reference), 1e-300)
        exact &= rel < 1e-10
        print(f"{mode:<12} {distributed:>16.12f} {reference:>16.12f} {rel:>10.1e}")
    return exact
