"""The long tail, measured: the same RL job run synchronously, with ``async_steps: 1`` and
with partial rollouts + streaming (``async_steps: 1, partial_rollout: true``), one after
the other in one process, on a task whose responses have a long tail (issue 53).

The task (a JSONL file this script writes): 7 prompts in 8 are ``copy`` ("cp abc=" →
"abc", 1–3 letters: 2–4 tokens with EOS), the 8th is ``repeat`` with a fixed count
("rep q 24=" → 24 × "q": 25 tokens), in that order, unshuffled, so every synchronous step
of 8 prompts holds exactly one long group. The tiny model is first taught both by a short
SFT warm start on the same mixture (other examples: its own seed; services/runtime/warmup.py
's loss), and the script checks that the tail is real before timing anything: the warm
model's sampled responses (T=1) to held-out prompts of each kind, their mean length and
exact match. Each run starts from that folder and goes through the real driver
(services/driver/loop.py run_job): 8 prompts × 8 samples a step, 32 new tokens, DP 1,
one torch engine actor (not colocated, so that generation can run beside training).

Per run, over the steps after the first (the first pays for start-up):

    trained samples/s, trained tokens/s  (prompt + response tokens the trainer saw) and
                                          the median s/step, from the wall clock of the
                                          metrics rows (one written at each step's end)
    learning curve                        per block of steps (equal trained samples in
                                          every run): mean reward of the trained copy and
                                          repeat samples (samples.jsonl logs all of them),
                                          and the repeat share of what was trained
    held-out exact match                  of the final weights: 8 samples at T=1 (what the
                                          reward sees; greedy answers are near perfect
                                          from the start) to each of 64 copy and 32 repeat
                                          held-out prompts by plain ``generate``, same
                                          seed for every model, ± its binomial standard
                                          error: "equal learning" is judged here too, since
                                          streaming trains whichever groups finish first
                                          and so may train another mix of the two kinds

and ``PARTIAL_SPEEDUP <x>``: the synchronous run's wall time per trained sample over the
partial run's (its config's defaults: partial_chunk_tokens 32 / 8 = 4, max_staleness
2k − 1 + 32 / 4 = 9, the least with which no group is ever dropped). Both knobs
matter here, so by default the script also runs a sweep: ``--chunks`` adds a partial run
for each partial_chunk_tokens value (the pause granularity: a long response needs 28 / C
rounds), ``--staleness`` one for each rollout.max_staleness value (a group holding a token
older is dropped from the pool; below the default the long responses cannot end in time,
and the column ``dropped`` and the repeat share show the bias); each prints its own
speed-up line beside PARTIAL_SPEEDUP. ``--chunks '' --staleness ''`` runs the three modes
only.

    .venv/bin/python benchmarks/async_rollout.py [--steps 100] [--prompts 8] [--group 8]
        [--long 24] [--warm-steps 150] [--chunks 8,16] [--staleness 4,8] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import string
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch
from transformers import AutoModelForCausalLM

from rollout.tasks import TaskExample
from rollout.tiny import resolve_model_path
from rollout.tokenizer import encode_prompt, load_tokenizer
from services.config.job import JobConfig, parse_job_config
from services.driver.loop import run_job
from services.driver.run_dir import data_dir
from services.driver.sinks import read_metrics
from services.runtime.quiet import quiet_transformers
from services.runtime.warmup import _supervised_loss

MAX_NEW_TOKENS = 32
THREADS = 1
"""Torch threads of the script's own work (warm start, evaluation): on the 2 shared cores
the warm start took 97 s with 2 threads and 4 s with 1."""
NUM_BLOCKS = 5  # blocks of steps the learning curve is printed in


# -- the long-tailed task --------------------------------------------------------------

def example(rng: random.Random, long: bool, repeat_count: int) -> TaskExample:
    """A copy prompt of 1–3 letters, or (``long``) a repeat of one letter ``repeat_count``
    times."""
    if long:
        char = rng.choice(string.ascii_lowercase)
        return TaskExample(f"rep {char} {repeat_count}=", char * repeat_count)
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 3)))
    return TaskExample(f"cp {word}=", word)


def task_examples(num: int, repeat_count: int, seed: int) -> list[TaskExample]:
    """``num`` examples, every 8th (index 7, 15, …) a long one."""
    rng = random.Random(seed)
    return [example(rng, i % 8 == 7, repeat_count) for i in range(num)]


def is_long(prompt: str) -> bool:
    return prompt.startswith("rep ")


# -- the start folder --------------------------------------------------------------------

def warm_start(folder: Path, repeat_count: int, steps: int, seed: int) -> str:
    """The tiny model after ``steps`` supervised steps on the mixture (32 examples a step,
    AdamW 3e-3, warmup.py's loss), saved in ``folder``. The job's own ``warmup:`` trains on
    one synthetic task only, hence this."""
    source = resolve_model_path("tiny", data_dir() / "models")
    tokenizer = load_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    examples = task_examples(steps * 32, repeat_count, seed)
    random.Random(seed).shuffle(examples)  # a batch holds both kinds in the file's ratio
    torch.manual_seed(seed)
    model.train()
    for step in range(steps):
        loss = _supervised_loss(model, tokenizer, examples[step * 32:(step + 1) * 32])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@torch.inference_mode()
def sample_check(model_dir: str | Path, tokenizer_dir: str, examples: list[TaskExample],
                 greedy: bool, samples: int = 1, seed: int = 0
                 ) -> dict[str, tuple[float, float, int]]:
    """Per kind (copy, repeat): (exact match, mean response tokens with EOS, count) of
    ``samples`` responses per prompt by plain ``generate``, greedy or at T=1. Prompts of
    one token length share a batch, so no row is padded."""
    tokenizer = load_tokenizer(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    torch.manual_seed(seed)
    by_length: dict[int, list[tuple[TaskExample, list[int]]]] = {}
    for e in examples:
        ids = encode_prompt(tokenizer, e.prompt)
        by_length.setdefault(len(ids), []).append((e, ids))
    scores: dict[str, list[tuple[bool, int]]] = {"copy": [], "repeat": []}
    for length, rows in by_length.items():
        sampling = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        out = model.generate(torch.tensor([ids for _, ids in rows for _ in range(samples)]),
                             do_sample=not greedy, max_new_tokens=MAX_NEW_TOKENS,
                             eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                             **sampling)
        for i, response in enumerate(out[:, length:].tolist()):
            e = rows[i // samples][0]
            n = response.index(eos) + 1 if eos in response else len(response)
            text = tokenizer.decode(response[:n], skip_special_tokens=True)
            scores["repeat" if is_long(e.prompt) else "copy"].append((text == e.answer, n))
    return {kind: (sum(c for c, _ in s) / len(s), sum(n for _, n in s) / len(s), len(s))
            for kind, s in scores.items()}


# -- the runs ----------------------------------------------------------------------------

MODES: dict[str, dict[str, Any]] = {
    "sync": {"async_steps": 0},
    "async 1": {"async_steps": 1},
    "async 1 + partial": {"async_steps": 1, "partial_rollout": True},
}
"""Each run's rollout settings over the shared config."""


def slug(name: str) -> str:
    """A run's name as a job name ("async 1 + partial" -> "async-1-partial")."""
    kept = "".join(c if c.isalnum() else " " for c in name.replace("≤", " le "))
    return "-".join(kept.split())


def job_config(name: str, model_path: str, dataset: Path, args: argparse.Namespace,
               rollout: dict[str, Any]) -> JobConfig:
    batch = args.prompts * args.group
    config = {
        "name": f"async-rollout-{name}", "num_steps": args.steps, "resume": False,
        "checkpoint_every": 0, "aggregation": {"mode": "sample_mean"},
        "logging": {"samples_per_step": batch, "sample_tokens": False},
        "rollout": {
            "model": model_path,
            "dataset": {"type": "jsonl", "path": str(dataset), "shuffle": False},
            "engine": {"type": "torch", "num_engines": 1},
            "sampling": {"temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS},
            "reward": {"type": "exact_match"},
            "advantage": {"type": "grpo", "normalize_std": True},
            "n_samples_per_prompt": args.group, "global_batch_size": batch, **rollout},
        "trainer": {
            "backend": "fsdp", "dp_size": 1,
            "loss": {"entropy_coef": 0.0},
            "optimizer": {"type": "adamw", "lr": args.lr, "grad_clip": 1.0,
                          "warmup_steps": 0, "schedule": "constant"}},
    }
    return parse_job_config(json.dumps(config), args.overrides)  # JSON is YAML


@dataclass
class Run:
    """One run's figures (steps after the first)."""

    name: str
    config: JobConfig
    step_s: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    rows: list[dict[str, float]] = field(default_factory=list)
    curve: list[dict[str, float]] = field(default_factory=list)
    final: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def seconds_per_sample(self) -> float:
        return sum(self.step_s) / sum(self.samples)

    def median(self, metric: str) -> float:
        values = [r[metric] for r in self.rows if metric in r]
        return statistics.median(values) if values else math.nan

    def mean(self, metric: str) -> float:
        values = [r[metric] for r in self.rows if metric in r]
        return statistics.fmean(values) if values else math.nan


def learning_curve(samples_file: Path, steps: int) -> list[dict[str, float]]:
    """Per block of steps: trained samples so far, mean reward of the copy and repeat
    samples trained in the block, and the repeat share of them."""
    per_step: dict[int, list[tuple[bool, float]]] = {}
    for line in samples_file.read_text().splitlines():
        row = json.loads(line)
        if not row.get("eval") and row.get("reward") is not None:
            per_step.setdefault(int(row["step"]), []).append(
                (is_long(str(row["record_prompt"])), float(row["reward"])))
    size = max(1, math.ceil(steps / NUM_BLOCKS))
    curve, trained = [], 0
    for start in range(0, steps, size):
        block = [s for step in range(start, min(start + size, steps))
                 for s in per_step.get(step, [])]
        trained += len(block)
        copy = [r for long, r in block if not long]
        rep = [r for long, r in block if long]
        curve.append({"steps": min(start + size, steps), "samples": trained,
                      "copy": statistics.fmean(copy) if copy else math.nan,
                      "repeat": statistics.fmean(rep) if rep else math.nan,
                      "repeat_share": len(rep) / len(block) if block else math.nan})
    return curve


def run(name: str, config: JobConfig, folder: Path, held_out: list[TaskExample],
        tokenizer_dir: str) -> Run:
    started = time.perf_counter()
    job_dir = folder / config.name

    def progress(line: str) -> None:  # the driver's step lines, one in 10
        words = str(line).split()
        if words[:1] == ["step"] and words[1].isdigit() and int(words[1]) % 10 == 9:
            print(f"[{name}] {line}", flush=True)

    run_job(config, job_dir, log=progress)
    result = Run(name, config, wall_s=time.perf_counter() - started)
    written = read_metrics(job_dir / "metrics.jsonl")
    for before, row in itertools.pairwise(written):
        result.step_s.append(row["time"] - before["time"])
        result.samples.append(config.rollout.global_batch_size)
        result.tokens.append(row["metrics"]["tokens/total"])
        result.rows.append(row["metrics"])
    result.curve = learning_curve(job_dir / "samples.jsonl", config.num_steps)
    torch.set_num_threads(THREADS)
    result.final = sample_check(job_dir / "final_model", tokenizer_dir, held_out,
                                greedy=False, samples=8)
    print(f"[{name}] done in {result.wall_s:.0f} s", flush=True)
    return result


# -- the table ---------------------------------------------------------------------------

def print_tables(runs: list[Run], start: dict[str, tuple[float, float, int]]) -> None:
    width = max(len(r.name) for r in runs) + 2
    print(f"\n{'run':<{width}} {'samples/s':>9} {'tokens/s':>9} {'s/step':>7} {'gen s':>6} "
          f"{'train s':>7} {'rounds':>7} {'partial':>8} {'stale':>6} {'dropped':>8} "
          f"{'gen overlap':>12}")
    for r in runs:
        print(f"{r.name:<{width}} {1 / r.seconds_per_sample:>9.1f} "
              f"{sum(r.tokens) / sum(r.step_s):>9,.0f} {statistics.median(r.step_s):>7.3f} "
              f"{r.median('rollout/gen_time_s'):>6.3f} {r.median('perf/train_s'):>7.3f} "
              f"{r.mean('rollout/partial_rounds'):>7.2f} "
              f"{r.mean('rollout/partial_fraction'):>8.2f} "
              f"{r.mean('rollout/staleness_mean'):>6.2f} "
              f"{sum(x.get('rollout/stale_dropped', 0.0) for x in r.rows):>8.0f} "
              f"{r.mean('perf/gen_overlap'):>12.2f}")
    print("(gen s, train s: medians of a step's engine generation (all rounds) and "
          "training; rounds: engine calls of C tokens per step; partial: share of trained samples "
          "spanning two versions or more; stale: mean token staleness; dropped: samples "
          "of groups dropped past max_staleness, all steps; gen overlap: share of generation "
          "hidden behind training)")
    print("\nlearning curve: mean reward of the trained copy/repeat samples per block of "
          "steps, and the repeat share of them")
    print(f"{'steps':>5} {'samples':>7} " + " ".join(f"{r.name:>17}" for r in runs))
    for i, block in enumerate(runs[0].curve):
        cells = [r.curve[i] for r in runs]
        print(f"{block['steps']:>5} {block['samples']:>7} " + " ".join(
            f"{c['copy']:>7.2f}/{c['repeat']:.2f} {c['repeat_share']:>3.0%}" for c in cells))
    print("\nheld-out exact match, 8 samples at T=1 per prompt (± binomial standard error)")
    print(f"{'':<{width}} {'copy':>15} {'repeat':>15}")
    for name, final in [("start", start), *((r.name, r.final) for r in runs)]:
        print(f"{name:<{width}} " + " ".join(
            f"{p:>7.3f} ± {math.sqrt(p * (1 - p) / n):.3f}"
            for p, _, n in (final["copy"], final["repeat"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="rollout steps per run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--long", type=int, default=24,
                        help="the repeat count of the long prompts (responses: it + EOS)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warm-steps", type=int, default=150,
                        help="SFT steps of the warm start on the mixture")
    parser.add_argument("--chunks", default="8,16",
                        help="partial_chunk_tokens values (divisors of 32), a partial run "
                             "each beside the default one (C = 32 / 8 = 4); empty: none")
    parser.add_argument("--staleness", default="4,8",
                        help="rollout.max_staleness values, a partial run each beside the "
                             "default one (2 · async_steps = 2); empty: none")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="a config override for every run (key=value)")
    args = parser.parse_args()
    names = [n.strip() for n in args.modes.split(",") if n.strip()]
    if unknown := [n for n in names if n not in MODES]:
        parser.error(f"--modes: unknown {unknown}; expected some of {list(MODES)}")
    if "sync" not in names or "async 1 + partial" not in names:
        parser.error("--modes: PARTIAL_SPEEDUP needs both sync and async 1 + partial")
    variants = [(n, MODES[n]) for n in names]
    for chunk in filter(None, args.chunks.split(",")):
        variants.append((f"partial C={chunk}", {**MODES["async 1 + partial"],
                                                "partial_chunk_tokens": int(chunk)}))
    for bound in filter(None, args.staleness.split(",")):
        variants.append((f"partial stale≤{bound}", {**MODES["async 1 + partial"],
                                                   "max_staleness": int(bound)}))
    started = time.perf_counter()
    torch.set_num_threads(THREADS)
    quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="async-rollout-") as tmp:
        folder = Path(tmp)
        dataset = folder / "long_tail.jsonl"
        records = task_examples(512, args.long, seed=0)
        dataset.write_text("".join(json.dumps({"prompt": e.prompt, "label": e.answer}) + "\n"
                                   for e in records))
        model_path = warm_start(folder / "start", args.long, args.warm_steps, seed=1)
        held_out = task_examples(256, args.long, seed=2)
        held_out = ([e for e in held_out if not is_long(e.prompt)][:64]
                    + [e for e in held_out if is_long(e.prompt)])
        tail = sample_check(model_path, model_path, held_out, greedy=False, samples=8)
        print(f"warm start ({args.warm_steps} SFT steps): sampled at T=1, mean response "
              f"tokens copy {tail['copy'][1]:.1f}, repeat {tail['repeat'][1]:.1f} "
              f"({tail['repeat'][1] / tail['copy'][1]:.1f}× longer); exact match copy "
              f"{tail['copy'][0]:.3f}, repeat {tail['repeat'][0]:.3f}", flush=True)
        runs = [run(name, job_config(slug(name), model_path, dataset, args, rollout),
                    folder, held_out, model_path) for name, rollout in variants]
    print(f"\n{args.steps} steps of {args.prompts} prompts × {args.group} samples (1 prompt "
          f"in 8 long: {args.long} tokens + EOS vs 1–3), {MAX_NEW_TOKENS} new tokens, T=1, "
          f"DP 1, one torch engine actor; figures over steps 2..{args.steps}")
    print_tables(runs, tail)
    by_name = {r.name: r for r in runs}
    sync = by_name["sync"].seconds_per_sample
    for r in runs[1:]:
        print(f"speed-up over sync (wall time per trained sample): {r.name} "
              f"{sync / r.seconds_per_sample:.2f}×")
    print(f"whole command: {time.perf_counter() - started:.0f} s")
    print(f"PARTIAL_SPEEDUP {sync / by_name['async 1 + partial'].seconds_per_sample:.2f}")


if __name__ == "__main__":
    main()
