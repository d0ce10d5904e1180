"""``tally train-rm`` vs TRL's ``RewardTrainer`` on the same pairs, one after the other in
one run: seconds per step and held-out accuracy side by side.

Both train configs/rm-math.yaml's reward model (SmolLM2-135M-Instruct's decoder with a
fresh score head) on the same pairs in the same order (Tally's cursor,
services/train_rm/data.py ``step_indices``, handed to TRL with a sequential sampler),
``pairs_per_step`` pairs a step, for ``num_steps`` steps, with the config's AdamW, lr,
warm-up + cosine schedule (the same formula on both sides) and gradient clip, fp32 on the
same 2 cores (TRL: one process with every core's thread; Tally: ``tally train-rm`` as a
user runs it, once per DP size asked for). Gradient checkpointing is off on both sides
unless ``--checkpointing`` (TRL's default is on; Tally's train-rm has none on CPU).

Per run: the median seconds of a step over steps 2..N (TRL: its callback's step begin to
step end; Tally: ``perf/step_time_s``, the whole ``train_pairs`` call), the whole
command's wall time (interpreter, imports, Ray or Trainer start-up, training, saving),
and the held-out accuracy of its final model on the config's test pairs, measured for
both by one function here (transformers' ``AutoModelForSequenceClassification`` score of
rollout/reward_text.py's ids, the score read at the last id: what a job's reward actor
serves), beside Tally's own ``eval/accuracy`` as a cross-check.

    .venv/bin/python benchmarks/rm_vs_trl.py [--config configs/rm-math.yaml] [--dp 1,2]
        [--steps N] [--skip-trl] [--skip-tally] [--checkpointing] [--keep DIR]
        [--venv ~/.cache/tally-bench/trl-venv]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_trl import DEFAULT_VENV, ensure_trl_venv, side_env  # noqa: E402


@dataclass
class Run:
    name: str
    step_s: float
    wall_s: float
    accuracy: float
    own_accuracy: float | None = None


def held_out_accuracy(model_dir: Path, pairs: list, chat_template: bool, max_length: int
                      ) -> float:
    """Share of test pairs whose chosen response scores above the rejected one, scored
    by transformers on the ids a job's reward actor feeds the model."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rollout.reward_text import encode_reward

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), dtype=torch.float32).eval()
    right = 0
    with torch.no_grad():
        for pair in pairs:
            scores = []
            for response in (pair.chosen, pair.rejected):
                ids = encode_reward(tokenizer, pair.prompt, response, chat_template,
                                    max_length).ids
                logits = model(torch.tensor([ids])).logits  # one row: no padding to skip
                scores.append(float(logits[0, -1, 0]) if logits.dim() == 3
                              else float(logits[0, 0]))
            right += scores[0] > scores[1]
    return right / len(pairs)


def median_after_first(seconds: list[float]) -> float:
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def run_trl(python: Path, config, model_path: str, train_pairs: list, out: Path,
            checkpointing: bool) -> tuple[list[float], float]:
    from services.train_rm.data import step_indices

    order = [i for step in range(config.num_steps)
             for i in step_indices(len(train_pairs), config.pairs_per_step, step, config.seed)]
    optimizer = config.trainer.optimizer
    spec = {"model": model_path, "output_dir": str(out), "steps": config.num_steps,
            "pairs_per_step": config.pairs_per_step, "lr": optimizer.lr,
            "warmup_steps": optimizer.warmup_steps, "min_lr_ratio": optimizer.min_lr_ratio,
            "grad_clip": optimizer.grad_clip, "max_length": config.max_length,
            "threads": len(os.sched_getaffinity(0)), "gradient_checkpointing": checkpointing,
            "pairs": [{"prompt": train_pairs[i].prompt, "chosen": train_pairs[i].chosen,
                       "rejected": train_pairs[i].rejected} for i in order]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    began = time.perf_counter()
    with open(out / "trl.log", "w") as log:
        subprocess.run([str(python), str(ROOT / "benchmarks" / "trl_rm_run.py"),
                        str(out / "spec.json")], check=True, stdout=log,
                       stderr=subprocess.STDOUT, env=side_env(), timeout=3 * 3600)
    wall = time.perf_counter() - began
    return json.loads((out / "steps.json").read_text())["seconds"], wall


def run_tally(config_path: Path, dp: int, steps: int | None, out: Path
              ) -> tuple[list[float], float, float | None]:
    command = [str(ROOT / ".venv" / "bin" / "tally"), "train-rm", str(config_path),
               "--output-dir", str(out), "--set", f"trainer.dp_size={dp}"]
    if steps is not None:
        command += ["--set", f"num_steps={steps}"]
    began = time.perf_counter()
    log_path = out.with_suffix(".log")
    with open(log_path, "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT,
                       env=side_env(), timeout=3 * 3600, cwd=ROOT)
    wall = time.perf_counter() - began
    rows = [json.loads(line)["metrics"]
            for line in (out / "metrics.jsonl").read_text().splitlines()]
    accuracy = next((r["eval/accuracy"] for r in reversed(rows) if "eval/accuracy" in r),
                    None)
    return [r["perf/step_time_s"] for r in rows], wall, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "rm-math.yaml")
    parser.add_argument("--dp", default="1,2", help="Tally's DP sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=None, help="num_steps override")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-tally", action="store_true")
    parser.add_argument("--checkpointing", action="store_true",
                        help="TRL with gradient checkpointing (its default)")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs here")
    args = parser.parse_args()

    from rollout.preference_pairs import read_preference_pairs
    from rollout.tiny import resolve_model_path
    from services.train_rm.config import load_reward_model_config

    overrides = [f"num_steps={args.steps}"] if args.steps else []
    config = load_reward_model_config(args.config, overrides)
    model_path = resolve_model_path(config.model)
    train_pairs = read_preference_pairs(config.data.train, "data.train", None)
    test_pairs = read_preference_pairs(config.data.test, "data.test", None)
    work = args.keep or Path(tempfile.mkdtemp(prefix="rm-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{config.num_steps} steps of {config.pairs_per_step} pairs, {model_path}, "
          f"{len(test_pairs)} held-out pairs; runs in {work}", flush=True)
    runs: list[Run] = []
    if not args.skip_trl:
        python = ensure_trl_venv(args.venv)
        seconds, wall = run_trl(python, config, model_path, train_pairs, work / "trl",
                                args.checkpointing)
        accuracy = held_out_accuracy(work / "trl" / "final_model", test_pairs,
                                     config.chat_template, config.max_length)
        runs.append(Run("TRL RewardTrainer" + (" (ckpt)" if args.checkpointing else ""),
                        median_after_first(seconds), wall, accuracy))
        print(f"  {runs[-1]}", flush=True)
    if not args.skip_tally:
        for dp in [int(d) for d in args.dp.split(",")]:
            out = work / f"tally-dp{dp}"
            seconds, wall, own = run_tally(args.config, dp, args.steps, out)
            accuracy = held_out_accuracy(out / "final_model", test_pairs,
                                         config.chat_template, config.max_length)
            runs.append(Run(f"tally train-rm dp={dp}", median_after_first(seconds), wall,
                            accuracy, own))
            print(f"  {runs[-1]}", flush=True)
    base = runs[0].step_s if runs else 1.0
    print(f"\n{'run':<26}{'s/step':>8}{'speed vs first':>16}{'wall s':>9}"
          f"{'held-out acc':>14}{'own eval/acc':>14}")
    for run in runs:
        own = "" if run.own_accuracy is None else f"{run.own_accuracy:.3f}"
        print(f"{run.name:<26}{run.step_s:>8.2f}{base / run.step_s:>15.2f}x{run.wall_s:>9.0f}"
              f"{run.accuracy:>14.3f}{own:>14}")


if __name__ == "__main__":
    main()
