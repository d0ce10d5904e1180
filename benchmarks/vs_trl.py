"""Tally vs TRL 1.16 ``GRPOTrainer`` on the same work, one after the other in one run.

Both start from the same model folder and see the same prompts at the same steps (TRL
gets them in the order Tally's cursor draws them, with ``shuffle_dataset=False``; with
partial rollouts a Tally step trains on the first whole groups to finish out of
(1 + async_steps) · P in flight, so its steps' prompts are drawn from the same order but
not split as TRL's are), with
the same settings: GRPO advantages scaled by the group's std, token-mean loss (TRL's
``dapo``), no KL (``beta=0``) and no entropy bonus, AdamW at a constant lr, gradient norm
clipped to 1, fp32 on CPU, no gradient checkpointing, one optimizer step per rollout, on
the same 2 cores (TRL: one process of 2 threads; Tally: its engine and trainer ranks with
the threads services/placement.phase_threads gives them). Tally runs once per DP size,
``rollout.async_steps`` value (default 1: rollout r+1 is generated while rollout r
trains; TIS corrects for the one-step staleness), ``colocate`` value (default 1: the
engine inside trainer rank 0, generating from its weights) and ``rollout.partial_rollout``
value (default 0; 1: samples continue across weight updates and a step takes the first
whole groups to finish, with the config's default ``partial_chunk_tokens`` and
``max_staleness``, docs/rollout.md "Partial rollouts and streaming") asked for; a
combination the job config refuses (partial 1 with async 0) is skipped with a printed
note.

    tiny     the 0.99 M-parameter Qwen2 with the character tokenizer (rollout/tiny.py), after
             the 50-step SFT warm start of services/runtime/warmup.py, on the synthetic `repeat`
             task at difficulty 3 (``rep c N=`` → c N times, N = 1…8; at difficulty 1 the
             warm start already answers 97% greedily), 64 prompts: 16 prompts × 8 samples
             per step, 16 new tokens, T=1, lr 1e-4, 60 steps
    smollm2  SmolLM2-135M-Instruct (rollout/pretrained.py) on math_words (last_number,
             numeric reward): 8 prompts × 4, 24 new tokens, T=0.8, lr 2e-5 (as
             configs/smollm2-math.yaml), 20 steps; only with --model smollm2: about 50 s a
             step on a 2-core CPU, so near an hour for TRL and both Tally layouts

Per run: median seconds per step (the wall clock from one step's end to the next: TRL's
on_step_end, the time of Tally's metrics row) and tokens/s (prompt + completion tokens /
those seconds) over steps 2..N, the wall time of its whole command (interpreter start,
imports, Ray or Trainer start-up, training, saving), the mean reward over the first and last 20% of
steps, and greedy accuracy (the task's reward: exact match, or numeric) on every prompt
of the task set, before and after, by one evaluation (plain ``generate``) of the start
folder and of each run's final weights. Each side runs as its own command:
``python -m services.train`` in this environment, benchmarks/trl_grpo_run.py in TRL's.

TRL lives in its own virtual environment, created on first use (``trl==1.16.0`` over the
project's torch pin, requirements/cpu.txt as constraints); it is never a dependency of
Tally, and nothing in Tally imports it.

    .venv/bin/python benchmarks/vs_trl.py [--model tiny|smollm2] [--steps 60] [--dp 1,2]
        [--async-steps 0,1] [--colocate 0,1] [--partial 0,1]
        [--warm-steps 50] [--skip-trl] [--skip-tally] [--venv ~/.cache/tally-bench/trl-venv]
        [--keep DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, GenerationConfig

from rollout.config import RewardConfig, SyntheticDatasetConfig
from rollout.cursor import PromptCursor
from rollout.datasets import PromptRecord, load_prompt_dataset
from rollout.pretrained import SMOLLM2_NAME
from rollout.rewards import reward_function
from rollout.tiny import resolve_model_path
from rollout.tokenizer import encode_prompt, eos_token_ids, load_tokenizer
from services.config.job import JobConfig, WarmupConfig
from services.driver.run_dir import data_dir
from services.runtime.quiet import QUIET_ENV, quiet_transformers
from services.runtime.warmup import warm_start

ROOT = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
THREADS = 2
DEFAULT_VENV = Path.home() / ".cache" / "tally-bench" / "trl-venv"


@dataclass(frozen=True)
class Workload:
    """One piece of work both frameworks run."""

    model: str
    dataset: dict[str, Any]
    reward: str
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float
    lr: float
    steps: int
    warm_start: bool


WORKLOADS = {
    "tiny": Workload("tiny", {"type": "synthetic", "task": "repeat", "difficulty": 3,
                              "num_prompts": 64}, "exact_match", 16, 8, 16, 1.0, 1e-4, 60,
                     True),
    "smollm2": Workload(SMOLLM2_NAME, {"type": "math_words", "difficulties": [1],
                                       "num_prompts": 64, "answer_format": "last_number"},
                        "numeric", 8, 4, 24, 0.8, 2e-5, 20, False),
}


@dataclass
class Run:
    """One framework's run: per-step figures, its command's wall time, its final weights."""

    name: str
    step_times: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    final_dir: Path | None = None
    accuracy_after: float = float("nan")
    phases: dict[str, float] = field(default_factory=dict)
    """Tally only: median seconds of each phase of a step (rollout, train, sync)."""
    partial: bool | None = None
    """Tally only: whether rollout.partial_rollout was on (None: TRL, which has none)."""


# -- the shared work -------------------------------------------------------------------

def start_folder(work: Workload, warm_steps: int) -> str:
    """The model folder both frameworks start from (the tiny model's warm start cached in
    the data folder, as a Tally job with warmup.num_steps=warm_steps computes it)."""
    path = resolve_model_path(work.model, data_dir() / "models")
    if not work.warm_start:
        return path
    return warm_start(path, SyntheticDatasetConfig(**work.dataset),
                      WarmupConfig(enabled=True, num_steps=warm_steps),
                      data_dir() / "warmup", log=lambda *_: None)


def drawn_records(records: list[PromptRecord], job: JobConfig, steps: int
                  ) -> list[PromptRecord]:
    """The prompts of every step in the order Tally's rollout manager draws them."""
    dataset = job.rollout.dataset
    cursor = PromptCursor(len(records), dataset.seed, dataset.shuffle)
    return [records[i] for _ in range(steps)
            for i in cursor.take(job.rollout.num_prompts_per_step)]


def job_config(work: Workload, model_path: str, steps: int, dp_size: int, async_steps: int,
               colocate: bool, partial: bool) -> JobConfig:
    return JobConfig.model_validate({
        "name": (f"vs-trl-dp{dp_size}-async{async_steps}-colocate{int(colocate)}"
                 f"-partial{int(partial)}"),
        "num_steps": steps, "resume": False, "colocate": colocate,
        "aggregation": {"mode": "token_mean"},
        "rollout": {
            "model": model_path, "dataset": work.dataset,
            "engine": {"type": "torch", "num_engines": 1, "num_threads": THREADS},
            "sampling": {"temperature": work.temperature,
                         "max_new_tokens": work.max_new_tokens},
            "reward": {"type": work.reward},
            "advantage": {"type": "grpo", "normalize_std": True},
            "n_samples_per_prompt": work.group_size, "async_steps": async_steps,
            "partial_rollout": partial,
            "global_batch_size": work.prompts_per_step * work.group_size},
        "trainer": {
            "backend": "fsdp", "dp_size": dp_size,
            "loss": {"entropy_coef": 0.0, "kl_coef": 0.0},
            "optimizer": {"type": "adamw", "lr": work.lr, "grad_clip": 1.0,
                          "warmup_steps": 0, "schedule": "constant"}},
    })


@torch.inference_mode()
def greedy_accuracy(model_dir: str | Path, tokenizer_dir: str, records: list[PromptRecord],
                    work: Workload) -> float:
    """Mean reward of the greedy answer to each record, by plain ``generate``; prompts of
    one token length share a batch, so no row is padded."""
    tokenizer = load_tokenizer(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos = eos_token_ids(tokenizer, model.generation_config.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    greedy = GenerationConfig(do_sample=False, max_new_tokens=work.max_new_tokens,
                              eos_token_id=eos, pad_token_id=pad)
    by_length: dict[int, list[tuple[int, list[int]]]] = {}
    for i, record in enumerate(records):
        ids = encode_prompt(tokenizer, record.prompt)
        by_length.setdefault(len(ids), []).append((i, ids))
    texts = [""] * len(records)
    for length, rows in by_length.items():
        for start in range(0, len(rows), 64):
            chunk = rows[start:start + 64]
            out = model.generate(torch.tensor([ids for _, ids in chunk]),
                                 generation_config=greedy)
            decoded = tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
            for (i, _), text in zip(chunk, decoded, strict=True):
                texts[i] = text
    score = reward_function(RewardConfig(type=work.reward))
    rewards = score(texts, [r.label for r in records], [r.metadata for r in records])
    return sum(rewards) / len(rewards)


def run_command(command: list[str], log_file: Path, env: dict[str, str]) -> float:
    """Run one side's command, its output to ``log_file``; its wall time in seconds."""
    started = time.perf_counter()
    with log_file.open("w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, check=False)
    wall = time.perf_counter() - started
    if result.returncode:
        tail = "".join(log_file.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{' '.join(command[:3])} … exited {result.returncode}; "
                           f"last lines of {log_file}:\n{tail}")
    return wall


def side_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    return {**env, **QUIET_ENV, "CUDA_VISIBLE_DEVICES": "", **extra}


def walls(end_times: list[float]) -> list[float]:
    """Seconds of steps 2..N from the wall clock at the end of each step (each side's
    own bookkeeping between steps included; step 1, with its warm-up, left out)."""
    return [b - a for a, b in itertools.pairwise(end_times)]


# -- TRL -------------------------------------------------------------------------------

def torch_pin() -> str:
    """The project's torch pin (requirements/cpu.txt)."""
    for line in (ROOT / "requirements" / "cpu.txt").read_text().splitlines():
        if line.startswith("torch=="):
            return line.strip()
    raise RuntimeError("requirements/cpu.txt pins no torch")


def ensure_trl_venv(venv: Path, log=print) -> Path:
    """The TRL environment's python: trl==TRL_VERSION over the project's torch pin,
    created with ``python -m venv`` and pip on first use."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import trl, torch; print(trl.__version__, torch.__version__)"]
    if python.exists():
        found = subprocess.run(probe, capture_output=True, text=True, check=False)
        if found.returncode == 0 and found.stdout.split()[0] == TRL_VERSION:
            return python
    log(f"creating the TRL environment in {venv} (trl=={TRL_VERSION}, {torch_pin()})")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, torch_pin()], check=True)
    constrained = subprocess.run(
        [*pip, f"trl=={TRL_VERSION}", torch_pin(), "-c", str(ROOT / "requirements" / "cpu.txt")],
        capture_output=True, text=True, check=False)
    if constrained.returncode:
        log(f"pip: trl=={TRL_VERSION} does not resolve within requirements/cpu.txt:\n"
            f"{constrained.stderr.strip()}\nretrying with only {torch_pin()} pinned")
        subprocess.run([*pip, f"trl=={TRL_VERSION}", torch_pin()], check=True)
    trl_version, torch_version = subprocess.run(probe, capture_output=True, text=True,
                                                check=True).stdout.split()
    log(f"TRL environment ready: trl {trl_version}, torch {torch_version}")
    return python


def run_trl(python: Path, work: Workload, model_path: str, records: list[PromptRecord],
            steps: int, run_dir: Path) -> Run:
    run_dir.mkdir(parents=True)
    spec = {"model": model_path, "steps": steps, "prompts_per_step": work.prompts_per_step,
            "group_size": work.group_size, "max_new_tokens": work.max_new_tokens,
            "temperature": work.temperature, "lr": work.lr, "reward": work.reward,
            "threads": THREADS, "seed": 0, "output_dir": str(run_dir),
            "records": [{"prompt": r.prompt, "answer": r.label} for r in records]}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    metrics = run_dir / "metrics.jsonl"
    wall = run_command([str(python), str(ROOT / "benchmarks" / "trl_grpo_run.py"),
                        str(run_dir / "spec.json"), str(metrics)], run_dir / "trl.log",
                       side_env(OMP_NUM_THREADS=str(THREADS)))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return Run("TRL 1.16 GRPOTrainer", walls([r["end_time"] for r in rows]),
               [r["tokens"] for r in rows], [r["reward_mean"] for r in rows], wall,
               run_dir / "final")


# -- Tally -----------------------------------------------------------------------------

def run_tally(job: JobConfig, run_dir: Path) -> Run:
    run_dir.mkdir(parents=True)
    config_file = run_dir / "job.json"  # JSON is YAML: load_job_config reads it as is
    config_file.write_text(job.model_dump_json(indent=2))
    job_dir = run_dir / "job"
    wall = run_command([sys.executable, "-m", "services.train", str(config_file),
                        "--output-dir", str(job_dir)], run_dir / "tally.log",
                       side_env(PYTHONPATH=str(ROOT)))
    written = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    ends = [row["time"] for row in written]
    rows = [row["metrics"] for row in written]
    phases = {name: statistics.median(m[f"perf/{name}_s"] for m in rows[1:] or rows)
              for name in ("rollout", "train", "sync")}
    phases["generation (hidden share)"] = statistics.median(
        m["perf/gen_overlap"] for m in rows[1:] or rows)
    if job.rollout.partial_rollout:  # how far the samples trained on spanned versions
        for name in ("partial_fraction", "staleness_mean", "staleness_max"):
            phases[name] = statistics.median(m[f"rollout/{name}"] for m in rows)
        phases["stale_dropped (sum)"] = sum(m.get("rollout/stale_dropped", 0.0) for m in rows)
    rows = [m for m in rows if "perf/step_time_s" in m]  # a skipped step has no phases
    name = (f"Tally DP={job.trainer.dp_size} async={job.rollout.async_steps}"
            f"{' colocated' if job.colocate else ''}")
    return Run(name, walls(ends),
               [m["tokens/total"] for m in rows], [m["reward/mean"] for m in rows], wall,
               job_dir / "final_model", phases=phases, partial=job.rollout.partial_rollout)


# -- the table -------------------------------------------------------------------------

def share_mean(values: list[float], first: bool) -> float:
    count = max(1, round(0.2 * len(values)))
    part = values[:count] if first else values[-count:]
    return sum(part) / len(part)


def print_table(runs: list[Run], accuracy_before: float) -> None:
    print(f"{'run':<28} {'partial':>7} {'s/step':>7} {'tokens/s':>9} {'wall s':>7} "
          f"{'reward 1st 20%':>15} {'last 20%':>9} {'greedy before':>14} {'after':>6} "
          f"{'speed vs TRL':>13}")
    reference = next((r for r in runs if r.name.startswith("TRL")), None)
    reference_step = statistics.median(reference.step_times) if reference else None
    for run in runs:
        times, tokens = run.step_times, run.tokens[1:] or run.tokens
        step = statistics.median(times)
        ratio = f"{reference_step / step:>12.2f}×" if reference_step else f"{'—':>13}"
        partial = "—" if run.partial is None else str(int(run.partial))
        print(f"{run.name:<28} {partial:>7} {step:>7.3f} {sum(tokens) / sum(times):>9,.0f} "
              f"{run.wall_s:>7.1f} {share_mean(run.rewards, True):>15.3f} "
              f"{share_mean(run.rewards, False):>9.3f} {accuracy_before:>14.3f} "
              f"{run.accuracy_after:>6.3f} {ratio}")
    for run in runs:
        if run.phases:
            label = f"{run.name}{' partial' if run.partial else ''}"
            print(f"{label}: medians per step (phases in s): " + ", ".join(
                f"{name} {seconds:.3f}" for name, seconds in run.phases.items()))


def tally_jobs(work: Workload, model_path: str, steps: int, dp_sizes: list[int],
               args: argparse.Namespace) -> list[JobConfig]:
    """One job per DP size × async_steps × colocate × partial value; a combination the job
    config refuses (partial 1 with async 0) is skipped with a note naming the rule."""
    jobs = []
    for dp, k, c, p in itertools.product(dp_sizes, args.async_steps.split(","),
                                         args.colocate.split(","), args.partial.split(",")):
        try:
            jobs.append(job_config(work, model_path, steps, dp, int(k), bool(int(c)),
                                   bool(int(p))))
        except ValidationError as error:
            said = "; ".join(e["msg"] for e in error.errors())
            print(f"skipped: Tally DP={dp} async={k} colocate={c} partial={p}: {said}")
    if not jobs:
        raise SystemExit("no Tally run left: every combination asked for was refused")
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument("--steps", type=int, default=None,
                        help="RL steps per run (default: 60 tiny, 20 smollm2)")
    parser.add_argument("--warm-steps", type=int, default=50,
                        help="SFT warm-start steps of the tiny model")
    parser.add_argument("--dp", default="1,2", help="Tally's DP sizes, one run each")
    parser.add_argument("--async-steps", default="1",
                        help="Tally's rollout.async_steps values, one run each per DP size")
    parser.add_argument("--colocate", default="1",
                        help="Tally's colocate values (1: generation inside the trainer "
                             "ranks, the colocated fast path), one run each")
    parser.add_argument("--partial", default="0",
                        help="Tally's rollout.partial_rollout values (1: samples continue "
                             "across weight updates; needs async ≥ 1), one run each")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-tally", action="store_true")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                        help="TRL's virtual environment (created when missing)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep each run's folder (logs, metrics, final weights) here")
    args = parser.parse_args()
    started = time.perf_counter()
    work = WORKLOADS[args.model]
    steps = args.steps or work.steps
    torch.set_num_threads(THREADS)
    quiet_transformers()
    model_path = start_folder(work, args.warm_steps)
    dp_sizes = [int(d) for d in args.dp.split(",")]
    jobs = tally_jobs(work, model_path, steps, dp_sizes, args)
    records = load_prompt_dataset(jobs[0].rollout.dataset)
    accuracy_before = greedy_accuracy(model_path, model_path, records, work)
    print(f"{args.model}: {work.prompts_per_step} prompts × {work.group_size} samples, "
          f"{work.max_new_tokens} new tokens, T={work.temperature:g}, lr {work.lr:g}, "
          f"{steps} steps, {len(records)} task prompts; start folder {model_path}")
    python = None if args.skip_trl else ensure_trl_venv(args.venv)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix="vs-trl-", dir=args.keep)
        if python is not None:
            runs.append(run_trl(python, work, model_path, drawn_records(records, jobs[0], steps),
                                steps, Path(tmp) / "trl"))
        if not args.skip_tally:
            runs += [run_tally(job, Path(tmp) / job.name) for job in jobs]
        for run in runs:
            run.accuracy_after = greedy_accuracy(run.final_dir, model_path, records, work)
            print(f"{run.name}: {len(run.step_times) + 1} steps, wall {run.wall_s:.1f} s")
    print(f"\nmedian s/step (wall clock from one step's end to the next) and tokens/s over "
          f"steps 2..{steps}; greedy accuracy on all "
          f"{len(records)} task prompts")
    print_table(runs, accuracy_before)
    print(f"\nwhole command: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
