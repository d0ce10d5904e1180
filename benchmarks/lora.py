"""LoRA against full fine-tuning, side by side in one run (issue #22), on
SmolLM2-135M-Instruct (or the tiny model): one FSDP rank in this process, no Ray, the
same math_words-like batch (16 samples in groups of 4: prompts 60-90 tokens, responses
24), the same optimizer settings.

For each: trainable parameters, optimizer-state bytes (AdamW's moments and step), bytes
per weight sync to an fp32 and to a bf16 engine (what ``weight_bucket_specs`` plans: the
whole model, or the adapters' A and s·B), train s/step (median over the steps after a
warm-up one: forward, backward, optimizer) and the rank's peak memory in the step.

    .venv/bin/python benchmarks/lora.py [--model smollm2|tiny] [--steps 4] [--rank 16]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.step_throughput import length_mix_batch
from rollout.pretrained import SMOLLM2_NAME
from rollout.tiny import resolve_model_path
from services.driver.run_dir import data_dir
from trainer.config import (
    LoraConfig,
    ObjectiveConfig,
    OptimizerConfig,
    TrainerConfig,
)
from trainer.step_plan import plan_step

BUDGET = 4096


def measure(model_path: str, lora: LoraConfig | None, steps: int, vocab: int
            ) -> dict[str, float]:
    import torch.distributed as dist

    from trainer.backends.fsdp.worker import FSDPWorker

    batch = length_mix_batch(16, 4, (60, 91), (24, 24), False, vocab)
    config = TrainerConfig(dp_size=1, max_tokens_per_micro_batch=BUDGET, num_threads=2,
                           lora=lora, optimizer=OptimizerConfig(lr=1e-5))
    objective = ObjectiveConfig()
    worker = FSDPWorker(config, objective, model_path, 0, total_steps=steps + 1)
    worker.setup(*worker.rendezvous_address("127.0.0.1"))
    try:
        plan = plan_step(batch, objective, 1, 1, BUDGET)
        times, peaks = [], []
        for _ in range(steps + 1):
            started = time.perf_counter()
            metrics = worker.train_step(batch, plan)
            times.append(time.perf_counter() - started)
            peaks.append(metrics.get("perf/peak_mem_gb/train", math.nan))
        state_bytes = sum(t.numel() * t.element_size() for s in worker.optimizer.state.values()
                          for t in s.values() if torch.is_tensor(t))
        sync = {dtype: sum(spec.num_bytes for bucket in worker.weight_bucket_specs(dtype, 256)
                           for spec in bucket) for dtype in ("float32", "bfloat16")}
        return {"trainable": sum(p.numel() for p in worker.trained),
                "total": sum(p.numel() for p in worker.model.parameters()),
                "optimizer_bytes": state_bytes, "sync_fp32": sync["float32"],
                "sync_bf16": sync["bfloat16"], "step_s": statistics.median(times[1:]),
                "peak_gb": max(peaks[1:])}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("TALLY_DATA_DIR", str(data_dir()))
    model = SMOLLM2_NAME if args.model == "smollm2" else "tiny"
    model_path = resolve_model_path(model, data_dir() / "models")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    rows = {"full fine-tuning": measure(model_path, None, args.steps, vocab),
            f"LoRA r={args.rank}, all-linear": measure(model_path, lora, args.steps, vocab)}
    full, adapted = rows.values()
    print(f"{model}: one FSDP rank, 16 samples (prompts 60-90, responses 24), "
          f"{args.steps} timed steps")
    print(f"{'':<26}{'trainable':>14}{'optimizer state':>17}{'sync fp32':>12}"
          f"{'sync bf16':>12}{'train s/step':>14}{'peak GB':>9}")
    for name, row in rows.items():
        print(f"{name:<26}{row['trainable']:>14,}{row['optimizer_bytes'] / 2**20:>14.1f} MB"
              f"{row['sync_fp32'] / 2**20:>9.1f} MB{row['sync_bf16'] / 2**20:>9.1f} MB"
              f"{row['step_s']:>14.2f}{row['peak_gb']:>9.2f}")
    print(f"{'LoRA / full':<26}{adapted['trainable'] / full['trainable']:>14.4f}"
          f"{adapted['optimizer_bytes'] / full['optimizer_bytes']:>17.4f}"
          f"{adapted['sync_fp32'] / full['sync_fp32']:>12.4f}"
          f"{adapted['sync_bf16'] / full['sync_bf16']:>12.4f}"
          f"{adapted['step_s'] / full['step_s']:>14.2f}"
          f"{adapted['peak_gb'] / full['peak_gb']:>9.2f}")


if __name__ == "__main__":
    main()
