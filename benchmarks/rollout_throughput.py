"""Generated tokens/s of rollout's torch engine on the tiny model, on CPU.

Compares, for a few batch sizes (samples per step):

    bare      ``model.generate`` (HF, sampling) in this process, torch threads = --threads
    ray ×k    ``RolloutManager.generate_batch`` through Ray with k torch-engine actors
              (each --threads torch threads): sharding, sampling, rewards and the
              RolloutBatch included, timed from the driver

Tokens are the generated ones (up to and including EOS, no padding). Each timing is the
median of --repeats steps after one warm-up step. Starts and stops its own local Ray,
before the bare loop too, so that both face the same background processes.

    .venv/bin/python benchmarks/rollout_throughput.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray
import torch
from transformers import AutoModelForCausalLM

from rollout.config import RolloutConfig
from rollout.manager import RolloutManagerActor
from rollout.tasks import make_task_examples
from rollout.tiny import create_tiny_checkpoint
from rollout.tokenizer import load_tokenizer
from services.runtime.gang import start_rollout_actors

GROUP_SIZE = 4


def bare_generate_tokens_per_s(
    model_path: str, batch_size: int, max_new_tokens: int, repeats: int
) -> float:
    """HF model.generate on the same prompts the manager draws (left-padded)."""
    tokenizer = load_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    prompts = [e.prompt for e in make_task_examples("copy", 1, 0, batch_size // GROUP_SIZE)]
    prompts = [p for p in prompts for _ in range(GROUP_SIZE)]
    encoded = tokenizer(prompts, padding=True, return_tensors="pt")
    rates = []
    for i in range(repeats + 1):
        torch.manual_seed(i)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **encoded,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        elapsed = time.perf_counter() - start
        new = out[:, encoded["input_ids"].shape[1] :]
        # Generated tokens: everything up to and including the first EOS of each row.
        is_eos = (new == tokenizer.eos_token_id).int()
        after_eos = (is_eos.cumsum(-1) - is_eos) > 0
        if i:  # the first call is the warm-up
            rates.append(int((~after_eos).sum()) / elapsed)
    return statistics.median(rates)


def ray_tokens_per_s(
    model_path: str,
    num_engines: int,
    batch_size: int,
    max_new_tokens: int,
    repeats: int,
    threads: int,
) -> tuple[float, float]:
    """(driver-timed tokens/s of generate_batch, the engines' own tokens/s)."""
    config = RolloutConfig.model_validate(
        {
            "dataset": {"type": "synthetic", "task": "copy", "num_prompts": 4096},
            "engine": {
                "type": "torch",
                "num_engines": num_engines,
                "batch_size": batch_size,
                "num_threads": threads,
            },
            "sampling": {"max_new_tokens": max_new_tokens},
            "n_samples_per_prompt": GROUP_SIZE,
            "global_batch_size": batch_size,
        }
    )
    actors = start_rollout_actors(config, model_path)
    manager = RolloutManagerActor.remote(config, model_path, engines=actors.engines,
                                         owns_engines=True, teachers=actors.teachers,
                                         reward_actors=actors.reward_actors)
    try:
        ray.get(manager.generate_batch.remote(0))  # warm-up (and waits for the engines)
        rates, engine_rates = [], []
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            batch = ray.get(manager.generate_batch.remote(step))
            elapsed = time.perf_counter() - start
            rates.append(batch.metadata["rollout/gen_tokens"] / elapsed)
            engine_rates.append(batch.metadata["rollout/gen_tokens_per_s"])
        return statistics.median(rates), statistics.median(engine_rates)
    finally:
        ray.get(manager.shutdown.remote())
        ray.kill(manager)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model_path = create_tiny_checkpoint(tempfile.mkdtemp(prefix="tally-bench-") + "/tiny")
    # Ray first, so the bare loop runs beside the same Ray daemons the actors do.
    ray.init(
        address="local",  # always a fresh local cluster, never someone else's
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}},
    )
    try:
        bare = {
            b: bare_generate_tokens_per_s(model_path, b, args.max_new_tokens, args.repeats)
            for b in args.batch_sizes
        }
        rows = []
        for num_engines in args.engines:
            for b in args.batch_sizes:
                rate, engine_rate = ray_tokens_per_s(
                    model_path, num_engines, b, args.max_new_tokens, args.repeats, args.threads
                )
                rows.append((num_engines, b, rate, engine_rate))
    finally:
        ray.shutdown()

    print(
        f"\ntiny Qwen2 on CPU, {os.cpu_count()} cores, {args.threads} torch thread(s) per "
        f"process, max_new_tokens={args.max_new_tokens}, median of {args.repeats} steps\n"
    )
    print("| batch | bare generate tok/s | engines | ray tok/s | engine-only tok/s | ray/bare |")
    print("|------:|--------------------:|--------:|----------:|------------------:|---------:|")
    for num_engines, b, rate, engine_rate in rows:
        print(
            f"| {b:5d} | {bare[b]:19.0f} | {num_engines:7d} | {rate:9.0f} | "
            f"{engine_rate:17.0f} | {rate / bare[b]:7.0%} |"
        )


if __name__ == "__main__":
    main()
