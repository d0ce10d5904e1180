"""How much engine time a synchronous RL step leaves idle behind a long-tailed response,
computed (a model, not a measurement): the table of docs/rollout.md (issue 53) for a 7 B
model on 8 GPUs.

A decode step of an engine holding b sequences with contexts c_i is memory-bound until
its batch is large (the weights and every sequence's KV cache are read once per token):

    t(b) = max( (W + Σ_i c_i · kv) / BW ,  b · 2P / (FLOPS · mfu) ) + t_launch

with W = 2P bytes of bf16 weights, kv the KV bytes per token (Qwen2.5-7B: 28 layers × 4 KV
heads × 128 × 2 (K, V) × 2 bytes = 57,344), BW the GPU's memory bandwidth and t_launch a
fixed per-step overhead. One engine per GPU (tensor-parallel 1) serves its share of the
step's samples, all started together. The synchronous step ends when the engine's longest
response ends, and from the first response that ends on, the engine decodes a smaller
batch at a lower token rate. Its idle fraction is the share of its time it would not need
at its full-batch token rate:

    idle = 1 − (tokens decoded / rate(full batch)) / (time of the step)

Partial rollouts with streaming refill every finished slot with a new sample (the step
takes whole groups as they finish; the long one carries into a later step), so an engine
decodes near its full-batch rate throughout: 1 / (1 − idle) bounds their speed-up of the
generation phase.

    .venv/bin/python benchmarks/long_tail_idle.py [--samples 512] [--gpus 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    bandwidth: float = 3.35e12  # H100 SXM HBM3, bytes/s
    flops: float = 989e12  # bf16 dense
    mfu: float = 0.5  # of flops reached by a decode batch's GEMMs
    launch_s: float = 2e-3  # kernel launches, sampling, scheduler per decode step


@dataclass(frozen=True)
class Model:
    params: float = 7.6e9  # Qwen2.5-7B
    kv_bytes_per_token: int = 28 * 4 * 128 * 2 * 2


def step_time(contexts: list[int], model: Model, gpu: Gpu) -> float:
    """One decode step for sequences with these contexts (the formula above)."""
    memory = (2 * model.params + sum(contexts) * model.kv_bytes_per_token) / gpu.bandwidth
    compute = len(contexts) * 2 * model.params / (gpu.flops * gpu.mfu)
    return max(memory, compute) + gpu.launch_s


def engine_time(prompt_len: int, lengths: list[int], model: Model, gpu: Gpu) -> float:
    """The synchronous engine: all its samples start together; each step decodes the
    ones not finished. Steps between two finishes are summed in blocks (the KV grows
    linearly, so the block's mean context is exact for the memory term)."""
    remaining = sorted(lengths)
    total, done = 0.0, 0
    while remaining:
        block = remaining[0] - done  # steps until the shortest active one finishes
        mid = done + block / 2
        total += block * step_time([prompt_len + int(mid)] * len(remaining), model, gpu)
        done = remaining[0]
        remaining = [n for n in remaining if n > done]
    return total


def idle_fraction(prompt_len: int, lengths: list[int], model: Model, gpu: Gpu
                  ) -> tuple[float, float]:
    """(the synchronous engine's time, its idle fraction)."""
    busy = engine_time(prompt_len, lengths, model, gpu)
    mean_context = prompt_len + sum(lengths) / (2 * len(lengths))
    full_rate = len(lengths) / step_time([int(mean_context)] * len(lengths), model, gpu)
    return busy, 1 - (sum(lengths) / full_rate) / busy


def sample_lengths(n: int, tail: int, rng: random.Random) -> list[int]:
    """1 sample in 8 a long one (90–100 % of tail), the others 0.5k–3k tokens, in a
    random order (the engines' shares are slices of it)."""
    lengths = [int(tail * rng.uniform(0.9, 1.0)) if i % 8 == 7 else rng.randint(500, 3000)
               for i in range(n)]
    rng.shuffle(lengths)
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512, help="samples per step")
    parser.add_argument("--gpus", type=int, default=8, help="engines, one GPU each")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, gpu = Model(), Gpu()
    print(f"7B (Qwen2.5-7B shape), {args.gpus} × H100 engines, {args.samples} samples/step "
          f"({args.samples // args.gpus} per engine), 1 in 8 responses long")
    print(f"{'tail tokens':>11} {'sync s/step':>11} {'idle':>6} {'bound on speed-up':>18}")
    for tail in (4096, 8192, 16384, 32768):
        rng = random.Random(args.seed)
        lengths = sample_lengths(args.samples, tail, rng)
        per_engine = [lengths[e::args.gpus] for e in range(args.gpus)]
        results = [idle_fraction(args.prompt_len, share, model, gpu) for share in per_engine]
        step = max(t for t, _ in results)  # the step waits for the slowest engine
        # each engine idles its own share, and all of them wait for the slowest
        full = [t * (1 - idle) for t, idle in results]
        idle = 1 - sum(full) / (step * len(results))
        print(f"{tail:>11} {step:>11.1f} {idle:>6.0%} {1 / (1 - idle):>17.2f}×")


if __name__ == "__main__":
    main()
