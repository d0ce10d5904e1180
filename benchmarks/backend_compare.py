"""Train tokens/s of one optimizer step, torch FSDP2 vs Megatron-core, on the tiny model on
CPU: FSDP2 at DP=2, Megatron at DP=2 and at TP=2 (two ranks each, gloo, one thread per
rank). Tokens are the batch's real (unpadded) tokens; the time is the driver's wall time
of ``TrainerGroup.train`` (plan, object store, forward/backward, gradient reduction,
optimizer step), median over the measured steps after one warm-up step, the layouts
taking turns step by step.

    .venv/bin/python benchmarks/backend_compare.py [--steps 7] [--samples 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray
import torch

from rollout.batch import RolloutBatch
from rollout.tiny import create_tiny_checkpoint
from trainer.config import ObjectiveConfig, OptimizerConfig, TrainerConfig
from trainer.group import TrainerGroup

LAYOUTS = [("fsdp", 2, 1), ("megatron", 2, 1), ("megatron", 1, 2)]  # backend, dp, tp


def make_batch(num_samples: int, vocab_size: int, group_size: int = 8) -> RolloutBatch:
    """Prompts of 8-24 tokens, responses of 16-64, deterministic."""
    gen = torch.Generator().manual_seed(0)

    def randint(low: int, high: int, size: int = 1) -> list[int]:
        return torch.randint(low, high, (size,), generator=gen).tolist()

    prompts, responses, log_probs, groups = [], [], [], []
    for i in range(num_samples):
        if i % group_size == 0:
            prompt = randint(3, vocab_size, randint(8, 25)[0])
        length = randint(16, 65)[0]
        prompts.append(prompt)
        responses.append(randint(3, vocab_size, length))
        log_probs.append((-torch.rand(length, generator=gen) * 3).tolist())
        groups.append(i // group_size)
    rewards = torch.rand(num_samples, generator=gen)
    return RolloutBatch.from_samples(prompts, responses, log_probs, rewards.tolist(),
                                   (rewards - rewards.mean()).tolist(), groups, group_size)


def measure(model_path: str, batch: RolloutBatch, steps: int
            ) -> list[tuple[float, float]]:
    """Per layout: (median driver seconds per step, median rank-local compute seconds).

    Every layout's group is up at once and the steps are interleaved round by round, so a
    shared machine's load drifts over all layouts alike."""
    groups = [TrainerGroup(TrainerConfig(backend=backend, dp_size=dp, tp_size=tp,
                                         optimizer=OptimizerConfig(lr=1e-4)),
                           ObjectiveConfig(), model_path, total_steps=steps + 1)
              for backend, dp, tp in LAYOUTS]
    try:
        batch_ref = ray.put(batch)
        for group in groups:
            group.train(batch, batch_ref)  # warm-up: first-call allocations, lazy imports
        wall: list[list[float]] = [[] for _ in groups]
        compute: list[list[float]] = [[] for _ in groups]
        for _ in range(steps):
            for i, group in enumerate(groups):
                started = time.perf_counter()
                metrics = group.train(batch, batch_ref)
                wall[i].append(time.perf_counter() - started)
                compute[i].append(metrics["perf/compute_s"])
        return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, compute,
                                                                              strict=True)]
    finally:
        for group in groups:
            group.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--samples", type=int, default=64)
    args = parser.parse_args()
    # Room for every layout's ranks at once (they take turns); torch uses 1 thread a rank.
    ray.init(address="local", num_cpus=2 * len(LAYOUTS), include_dashboard=False,
             log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = create_tiny_checkpoint(tmp, seed=0)
        from transformers import AutoConfig

        batch = make_batch(args.samples, AutoConfig.from_pretrained(model_path).vocab_size)
        num_tokens = int(batch.sequence_lengths.sum())
        rows = [(*layout, *timing) for layout, timing in
                zip(LAYOUTS, measure(model_path, batch, args.steps), strict=True)]
    ray.shutdown()
    reference = num_tokens / rows[0][3]
    print(f"tiny model, {args.samples} samples, {num_tokens} tokens per step, CPU, "
          f"median of {args.steps} steps")
    print(f"{'backend':>9} {'layout':>9} {'step s':>7} {'compute s':>9} {'tokens/s':>9} "
          f"{'vs fsdp':>8}")
    for backend, dp, tp, wall, compute in rows:
        tokens_per_s = num_tokens / wall
        print(f"{backend:>9} {f'dp{dp}tp{tp}':>9} {wall:>7.3f} {compute:>9.3f} "
              f"{tokens_per_s:>9,.0f} {tokens_per_s / reference:>7.2f}x")


if __name__ == "__main__":
    main()
