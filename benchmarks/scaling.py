"""What grows with the model: train step, weight sync, checkpoint save and load of
Llama-shaped models (random weights, built here with ``transformers.LlamaConfig``, nothing
downloaded) at ~135M (SmolLM2-135M's shape), ~360M (SmolLM2-360M's) and ~1.1B (a
Llama-3.2-1B shape with SmolLM2's 49k vocabulary), on FSDP ranks in fp32 on CPU (gloo,
no Ray), at DP 1 and 2.

Each model is built once in a child process and saved with ``save_pretrained`` (bf16
safetensors, as published checkpoints are; the trainer loads fp32 master weights from it)
into a temp folder. Per (size, DP), in freshly spawned ranks:

1. ``setup`` an ``FSDPWorker`` and time ``train_step`` on a tiny synthetic batch (2
   prompts × 2 samples, a few tokens each: the step's cost is the weights, not the
   tokens); the fastest of ``--train-steps`` after the first counts (the first also
   allocates AdamW's state; the fastest, as a shared machine only ever adds time).
2. Weight sync to a bf16 engine: every bucket of ``weight_buckets("bfloat16",
   --bucket-mb)`` in a ``PeakMemory`` block, rank 0 counting the bytes (checked: 2 bytes
   per parameter, each tied weight once).
3. ``checkpoint(path)``: its seconds and each rank's peak extra memory.

Then in newly spawned ranks a fresh worker's ``load_checkpoint(path)`` in a
``PeakMemory`` block (a fresh process: its memory starts clean, with no freed pages of
the first worker to reuse). Peak extra = what the phase added above its entry level
(trainer/memory.py: anonymous RSS; page cache and mmapped files not counted). The bound
of a rank is its shard (its fp32 parameters + AdamW's two moments: 12 bytes per local
parameter) + the largest bucket; "within" says whether every rank's sync, save and load
stayed under it ("NO: load" names a phase over it). A fresh worker's load allocates
AdamW's state (8 bytes per local parameter, part of its shard) and reads into it in place
(trainer/backends/fsdp/model.init_adamw_state; torch's own ``_init_optim_state`` would
step once on zero gradients, 4 more bytes per parameter at the peak).

Memory: ~16 bytes per parameter at the train step's peak (weights, AdamW, gradients), so
1b at DP 1 needs ~18 GB; sizes run one at a time and each run frees all it held.

    .venv/bin/python benchmarks/scaling.py [--sizes 135m,360m,1b] [--dp 1,2]
        [--bucket-mb 256] [--train-steps 3] [--tmp-dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.distributed import run_ranks  # noqa: E402

GB = 1e9
COMMON = {"vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 2048,
          "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
SIZES = {  # hidden, layers, heads, kv heads, intermediate
    "135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "intermediate_size": 1536},
    "360m": {"hidden_size": 960, "num_hidden_layers": 32, "num_attention_heads": 15,
             "num_key_value_heads": 5, "intermediate_size": 2560},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 8192},
}


def build_model(path: str, size: str, seed: int = 0) -> int:
    """Save a random-init Llama of ``size`` at ``path``; its parameter count (each tied
    weight once). Run in a child process, so the parent never holds the model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**COMMON, **SIZES[size]))
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return params


def _worker(rank: int, port: int, model_path: str, dp: int, threads: int, steps: int):
    from transformers.utils import logging

    from trainer.backends.fsdp.worker import FSDPWorker
    from trainer.config import (
        AggregationConfig,
        LossConfig,
        ObjectiveConfig,
        OptimizerConfig,
        TrainerConfig,
    )

    config = TrainerConfig(dp_size=dp, num_threads=threads, max_tokens_per_micro_batch=256,
                           loss=LossConfig(old_log_probs="rollout"),
                           optimizer=OptimizerConfig(lr=1e-5))
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 10, 1.0)
    logging.disable_progress_bar()
    worker = FSDPWorker(config, objective, model_path, rank, total_steps=steps)
    worker.setup("127.0.0.1", port)
    return worker


def _say(rank: int, label: str, message: str) -> None:
    if rank == 0:
        print(f"  [{label}] {message}", flush=True)


def _local_params(worker) -> int:
    """The parameters this rank's shard holds (FSDP2 DTensor shards, dim-0 chunks)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
               for p in worker.model.parameters())


def train_sync_save(rank: int, port: int, model_path: str, dp: int, threads: int,
                    steps: int, bucket_mb: float, checkpoint_path: str, label: str) -> dict:
    """One rank: setup, ``steps`` train steps, one bf16 weight sync, one checkpoint."""
    from tests.trainer.helpers import random_train_batch
    from trainer.memory import PeakMemory
    from trainer.step_plan import plan_step

    started = time.perf_counter()
    worker = _worker(rank, port, model_path, dp, threads, steps)
    _say(rank, label, f"setup {time.perf_counter() - started:.1f}s")
    out = {"shard_params": _local_params(worker)}

    batch = random_train_batch(worker.model.config.vocab_size, num_prompts=2, group_size=2)
    plan = plan_step(batch, worker.objective, dp, 1, worker.config.max_tokens_per_micro_batch,
                     packed=True)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        metrics = worker.train_step(batch, plan)
        times.append(time.perf_counter() - started)
        _say(rank, label, f"train step {step + 1}/{steps} {times[-1]:.2f}s (peak extra "
                          f"{metrics['perf/peak_extra_mem_gb/train']:.2f} GB)")
    out["train_s"] = min(times[1:] or times)  # the first also allocates AdamW's state

    specs = worker.weight_bucket_specs("bfloat16", bucket_mb)
    out["bucket_bytes"] = max(sum(spec.num_bytes for spec in bucket) for bucket in specs)
    out["sync_bytes"] = out["sync_buckets"] = 0
    started = time.perf_counter()
    with PeakMemory(worker.device) as peak:
        for flat in worker.weight_buckets("bfloat16", bucket_mb):
            if flat is not None:
                out["sync_bytes"] += flat.numel()
                out["sync_buckets"] += 1
            del flat
    out["sync_s"] = time.perf_counter() - started
    out["sync_extra_gb"] = peak.extra_gb
    _say(rank, label, f"sync {out['sync_s']:.2f}s, {out['sync_buckets']} buckets, "
                      f"{out['sync_bytes'] / GB:.3f} GB (peak extra {peak.extra_gb:.2f} GB)")

    metrics = worker.checkpoint(checkpoint_path)
    out["save_s"] = metrics["perf/checkpoint_s"]
    out["save_extra_gb"] = metrics["perf/peak_extra_mem_gb/checkpoint"]
    _say(rank, label, f"checkpoint save {out['save_s']:.2f}s "
                      f"(peak extra {out['save_extra_gb']:.2f} GB)")
    return out


def load(rank: int, port: int, model_path: str, dp: int, threads: int, steps: int,
         checkpoint_path: str, label: str) -> dict:
    """One rank of a fresh worker: ``load_checkpoint`` timed, its peak extra memory."""
    from trainer.memory import PeakMemory

    worker = _worker(rank, port, model_path, dp, threads, steps)
    started = time.perf_counter()
    with PeakMemory(worker.device) as peak:
        worker.load_checkpoint(checkpoint_path)
    out = {"load_s": time.perf_counter() - started, "load_extra_gb": peak.extra_gb}
    _say(rank, label, f"checkpoint load {out['load_s']:.2f}s "
                      f"(peak extra {peak.extra_gb:.2f} GB)")
    return out


def measure(size: str, model_path: str, params: int, dp: int, args: argparse.Namespace,
            tmp: Path) -> dict:
    """Both spawned runs of one (size, DP); the row of the table."""
    label = f"{size} dp={dp}"
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // dp)
    checkpoint = tmp / f"checkpoint-{size}-dp{dp}"
    try:
        ranks = run_ranks(train_sync_save, dp, model_path, dp, threads, args.train_steps,
                          args.bucket_mb, str(checkpoint), label)
        loaded = run_ranks(load, dp, model_path, dp, threads, args.train_steps,
                           str(checkpoint), label)
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
    ranks = [{**saved, **read} for saved, read in zip(ranks, loaded, strict=True)]
    sync_bytes = ranks[0]["sync_bytes"]
    if sync_bytes != 2 * params:
        print(f"  [{label}] WARNING: sync sent {sync_bytes} bytes, 2 × params = {2 * params}")
    bounds = [(12 * r["shard_params"] + r["bucket_bytes"]) / GB for r in ranks]
    over = [phase for phase in ("sync", "save", "load")
            if any(r[f"{phase}_extra_gb"] > bound for r, bound in zip(ranks, bounds,
                                                                    strict=True))]
    return {"size": size, "params": params, "dp": dp,
            "train_s": max(r["train_s"] for r in ranks),
            "sync_s": max(r["sync_s"] for r in ranks), "bytes_per_param": sync_bytes / params,
            **{key: max(r[key] for r in ranks) for key in
               ("sync_extra_gb", "save_s", "save_extra_gb", "load_s", "load_extra_gb")},
            "shard_gb": max(12 * r["shard_params"] for r in ranks) / GB,
            "bound_gb": max(bounds), "over": over}


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\nwhat grows with the model (FSDP, fp32 + AdamW on CPU, gloo; sync to bf16 in "
          f"{args.bucket_mb:g} MB buckets; seconds and peak extra GB: the slowest / largest "
          "rank; bound = shard (12 B/param of the rank) + largest bucket)")
    print(f"{'size':>5} {'params':>7} {'dp':>3} {'train s':>8} {'sync s':>7} {'sync B/p':>8} "
          f"{'sync +GB':>8} {'save s':>7} {'save +GB':>8} {'load s':>7} {'load +GB':>8} "
          f"{'shard GB':>8} {'bound GB':>8} {'within':>9}")
    for r in rows:
        print(f"{r['size']:>5} {r['params'] / 1e6:>6.0f}M {r['dp']:>3} {r['train_s']:>8.2f} "
              f"{r['sync_s']:>7.2f} {r['bytes_per_param']:>8.3f} {r['sync_extra_gb']:>8.2f} "
              f"{r['save_s']:>7.2f} {r['save_extra_gb']:>8.2f} {r['load_s']:>7.2f} "
              f"{r['load_extra_gb']:>8.2f} {r['shard_gb']:>8.2f} {r['bound_gb']:>8.2f} "
              f"{'NO: ' + '+'.join(r['over']) if r['over'] else 'yes':>9}")
    for dp in sorted({r["dp"] for r in rows}):
        same = [r for r in rows if r["dp"] == dp]
        for small, big in itertools.pairwise(same):
            ratio = {key: big[key] / small[key] if small[key] else float("nan")
                     for key in ("params", "train_s", "sync_s", "save_s", "load_s")}
            print(f"note: dp={dp} {big['size']}/{small['size']}: params ×{ratio['params']:.2f}; "
                  f"train ×{ratio['train_s']:.2f}, sync ×{ratio['sync_s']:.2f}, "
                  f"save ×{ratio['save_s']:.2f}, load ×{ratio['load_s']:.2f} "
                  "(linear growth: each ≈ the params ratio)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="135m,360m,1b", help=f"of {','.join(SIZES)}")
    parser.add_argument("--dp", default="1,2", help="DP sizes (FSDP ranks)")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--train-steps", type=int, default=3,
                        help="train steps per run; the fastest after the first counts")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: cores / dp)")
    parser.add_argument("--tmp-dir", default=None,
                        help="where models and checkpoints go (1b: ~2 GB + ~13 GB)")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}, choose from {list(SIZES)}")
    dps = [int(d) for d in args.dp.split(",")]

    rows = []
    for size in sizes:
        with tempfile.TemporaryDirectory(dir=args.tmp_dir, prefix=f"scaling-{size}-") as tmp:
            started = time.perf_counter()
            model_path = str(Path(tmp) / "model")
            with mp.get_context("spawn").Pool(1) as pool:
                params = pool.apply(build_model, (model_path, size))
            print(f"[{size}] built {params / 1e6:.1f}M params in "
                  f"{time.perf_counter() - started:.1f}s", flush=True)
            for dp in dps:
                print(f"[{size} dp={dp}] spawning {dp} rank(s)", flush=True)
                rows.append(measure(size, model_path, params, dp, args, Path(tmp)))
    print_table(rows, args)


if __name__ == "__main__":
    main()
