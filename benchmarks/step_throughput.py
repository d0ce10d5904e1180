"""Throughput of the RL step on the tiny model on CPU, two tables in one run:

1. **Train step, padded vs packed vs shared prefix** (one FSDP rank, no Ray): padding
   fraction, trained tokens per step (what the forward computes) and train tokens/s
   (the batch's tokens / fwd+bwd+optimizer time) of the same batch with padded
   micro-batches, packed rows, and packed rows sharing each group's prompt, on the demo's
   batch (256 samples, responses ≤ 8 tokens), a math_words-like batch (prompts 60–90,
   responses 24) and a long-tail length mix (responses 4–512 tokens, log-uniform).
   Targets (issue #11): padding < 5% packed; tokens/s up by at least the padding saved;
   (issue #21) shared prefix trains fewer tokens, and is faster by about as much.
2. **End to end** (rollout + train + weight sync, real Ray), synchronous and with the
   async pipeline (``rollout.async_steps: 1``), with engine actors and on the colocated
   fast path (``colocate: true``: generation inside the trainer ranks): tokens/s, the
   shares of step time in generation and forward/backward, how much of generation ran
   hidden behind training (perf/gen_overlap), and orchestration, the rest (target < 10%).

    .venv/bin/python benchmarks/step_throughput.py [--steps 12] [--async-steps 0,1]
        [--colocate 0,1] [--dp 2] [--skip-e2e | --skip-packing]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rollout.batch import RolloutBatch
from rollout.tiny import create_tiny_checkpoint
from services.config.job import load_job_config
from trainer.config import ObjectiveConfig, OptimizerConfig, TrainerConfig
from trainer.step_plan import plan_step

ROOT = Path(__file__).resolve().parents[1]


def length_mix_batch(num_samples: int, group_size: int, prompt_range: tuple[int, int],
                     response_range: tuple[int, int], log_uniform: bool, vocab: int,
                     seed: int = 0) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    low, high = response_range
    prompts, responses, log_probs = [], [], []
    for _ in range(num_samples // group_size):
        prompt = torch.randint(3, vocab, (int(torch.randint(*prompt_range, (1,),
                                                            generator=gen)),), generator=gen)
        for _ in range(group_size):
            u = float(torch.rand((), generator=gen))
            n = (round(math.exp(math.log(low) + u * (math.log(high) - math.log(low))))
                 if log_uniform else low + int(u * (high - low + 1)))
            prompts.append(prompt.tolist())
            responses.append(torch.randint(3, vocab, (n,), generator=gen).tolist())
            log_probs.append([-1.0] * n)
    rewards = torch.rand(len(prompts), generator=gen)
    return RolloutBatch.from_samples(prompts, responses, log_probs, rewards.tolist(),
                                   (rewards - rewards.mean()).tolist(),
                                   [i // group_size for i in range(len(prompts))], group_size)


LAYOUTS = {"padded": (False, False), "packed": (True, False), "prefix": (True, True)}
"""Name -> (trainer.packing, trainer.shared_prefix)."""


def train_step_times(model_path: str, batch: RolloutBatch, layout: str, budget: int,
                     steps: int) -> tuple[float, int, list[float]]:
    """(padding fraction, trained tokens, seconds of each train_step after a warm-up
    one) on one in-process rank."""
    import torch.distributed as dist

    from trainer.backends.fsdp.worker import FSDPWorker

    packed, shared = LAYOUTS[layout]
    config = TrainerConfig(dp_size=1, max_tokens_per_micro_batch=budget, packing=packed,
                           shared_prefix=shared, num_threads=2,
                           optimizer=OptimizerConfig(lr=1e-5))
    objective = ObjectiveConfig()
    worker = FSDPWorker(config, objective, model_path, 0, total_steps=steps + 1)
    worker.setup(*worker.rendezvous_address("127.0.0.1"))
    try:
        plan = plan_step(batch, objective, 1, 1, budget, packed=packed, shared_prefix=shared)
        times = []
        for _ in range(steps + 1):
            started = time.perf_counter()
            worker.train_step(batch, plan)
            times.append(time.perf_counter() - started)
        return plan.padding_fraction, plan.computed_tokens, times[1:]
    finally:
        dist.destroy_process_group()


def packing_table(repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_path = create_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        config_file = Path(model_path) / "config.json"  # room for 512-token responses
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "max_position_embeddings": 1024}))
        vocab = config["vocab_size"]
        workloads = {
            "demo batch (256 × ≤8 new)": (length_mix_batch(256, 8, (8, 17), (1, 8), False,
                                                           vocab), 2048),
            "math_words-like (32 × 24)": (length_mix_batch(32, 4, (60, 91), (24, 24), False,
                                                           vocab), 4096),
            "long tail (64 × 4-512 new)": (length_mix_batch(64, 4, (16, 65), (4, 512), True,
                                                            vocab), 4096),
        }
        print(f"train step by layout (1 FSDP rank, 2 threads; {repeats} rounds of 3 steps "
              "each, layouts alternating; medians; tok/s = the batch's tokens / step time)")
        print(f"{'workload':<28} {'layout':<7} {'padding':>8} {'trained tok':>12} "
              f"{'tok/s':>9} {'vs padded':>10} {'vs packed':>10}")
        for name, (batch, budget) in workloads.items():
            times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
            padding: dict[str, float] = {}
            trained: dict[str, int] = {}
            for _ in range(repeats):  # alternating: a noisy machine slows all alike
                for layout in LAYOUTS:
                    padding[layout], trained[layout], more = train_step_times(
                        model_path, batch, layout, budget, 3)
                    times[layout] += more
            tokens = float(batch.sequence_lengths.sum())
            speed = {layout: tokens / statistics.median(t) for layout, t in times.items()}
            for layout in LAYOUTS:
                print(f"{name if layout == 'padded' else '':<28} {layout:<7} "
                      f"{padding[layout]:>8.1%} {trained[layout]:>12,} "
                      f"{speed[layout]:>9,.0f} {speed[layout] / speed['padded']:>9.2f}× "
                      f"{speed[layout] / speed['packed']:>9.2f}×")


def end_to_end_table(steps: int, batch_sizes: list[int], async_values: list[int],
                     colocate_values: list[bool], dp_size: int) -> None:
    from services.driver.loop import run_job

    print(f"\nend to end (demo config, DP={dp_size}, median of {steps - 2} steps; shares of "
          "the step time; orchestration = step − exposed generation − fwd+bwd, exposed "
          "generation = generation × (1 − hidden))")
    print(f"{'batch':>6} {'async':>5} {'coloc':>5} {'step s':>7} {'tokens/s':>9} "
          f"{'generate':>9} {'hidden':>7} {'fwd+bwd':>8} {'orchestration':>14} {'padding':>8}")
    for batch_size, async_steps, colocate in itertools.product(batch_sizes, async_values,
                                                              colocate_values):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ.setdefault("TALLY_DATA_DIR", str(Path(tmp) / "data"))
            config = load_job_config(ROOT / "configs" / "demo.yaml", [
                f"num_steps={steps}", f"rollout.global_batch_size={batch_size}",
                "warmup.num_steps=60", f"rollout.async_steps={async_steps}",
                f"colocate={str(colocate).lower()}", f"trainer.dp_size={dp_size}"])
            history = run_job(config, Path(tmp) / "job", log=lambda *_: None)[2:]
        step = statistics.median(m["perf/step_time_s"] for m in history)
        tokens = statistics.median(m["perf/tokens_per_s"] for m in history)
        generate = statistics.median(m["rollout/gen_time_s"] for m in history)
        hidden = statistics.median(m["perf/gen_overlap"] for m in history)
        compute = statistics.median(m["perf/compute_s"] for m in history)
        padding = statistics.median(m["padding_fraction"] for m in history)
        orchestration = max(0.0, step - generate * (1 - hidden) - compute) / step
        print(f"{batch_size:>6} {async_steps:>5} {int(colocate):>5} {step:>7.2f} "
              f"{tokens:>9,.0f} {generate / step:>9.1%} {hidden:>7.1%} {compute / step:>8.1%} "
              f"{orchestration:>14.1%} {padding:>8.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="end-to-end steps per run")
    parser.add_argument("--repeats", type=int, default=4,
                        help="alternating rounds of the packing table")
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--async-steps", default="0,1",
                        help="rollout.async_steps of the end-to-end runs")
    parser.add_argument("--colocate", default="0,1",
                        help="colocate values of the end-to-end runs (1: the colocated fast "
                             "path, generation inside the trainer ranks)")
    parser.add_argument("--dp", type=int, default=2, help="DP size of the end-to-end runs")
    parser.add_argument("--skip-e2e", action="store_true", help="only the packing table")
    parser.add_argument("--skip-packing", action="store_true", help="only the e2e table")
    args = parser.parse_args()
    if not args.skip_packing:
        packing_table(args.repeats)
    if not args.skip_e2e:
        end_to_end_table(args.steps, [int(b) for b in args.batch_sizes.split(",")],
                         [int(k) for k in args.async_steps.split(",")],
                         [bool(int(c)) for c in args.colocate.split(",")], args.dp)


if __name__ == "__main__":
    main()
