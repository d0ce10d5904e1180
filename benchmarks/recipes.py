"""GRPO vs GSPO vs CISPO vs Dr. GRPO on SmolLM2 math, one after the other in one run
(issue 54; the recipes' configs are rows of docs/recipes.md).

Each recipe is the config (default configs/smollm2-math.yaml) with these overrides, run
for ``--steps`` rollout steps through the real driver (services/driver/loop.py run_job),
same seed, same prompts:

    grpo     aggregation.mode: sample_mean, policy_loss: ppo       TRL loss_type grpo
    gspo     aggregation.mode: sample_mean, policy_loss: gspo      TRL importance_sampling_level:
             (its ε 3e-4 / 4e-4)                                   sequence
    cispo    aggregation.mode: token_mean, policy_loss: cispo,     TRL loss_type cispo,
             eps_clip_high: 4.0                                    epsilon_high 5.0
    dr_grpo  aggregation: {mode: constant, divisor:                TRL loss_type dr_grpo,
             max_response_len}, advantage.normalize_std: false     scale_rewards none

With one optimizer step per rollout and one pass, π_old is the policy being trained and
every ratio is exactly 1: GSPO is then GRPO and CISPO is token-mean REINFORCE, whatever
their clips. ``--ppo-epochs`` (default 2) makes the later passes off-policy so that the
recipes' ratios and clips act; ``--ppo-epochs 1`` gives the config's on-policy run.

Per recipe: held-out accuracy (``eval/accuracy``: greedy, the config's eval prompts) of
the start and of the final weights (the driver evaluates the start only when at least two
steps follow it, services/driver/evaluation.py: with ``--steps 1`` it prints nan), seconds
per step (median of ``perf/step_time_s`` over the steps after the first, or the one
step's), the last step's mean reward and the job's wall time.

    .venv/bin/python benchmarks/recipes.py [--steps 24] [--recipes grpo,gspo,cispo,dr_grpo]
        [--ppo-epochs 2] [--config configs/smollm2-math.yaml] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.config.job import load_job_config
from services.driver.loop import run_job

ROOT = Path(__file__).resolve().parents[1]
RECIPES: dict[str, list[str]] = {
    "grpo": ["aggregation={mode: sample_mean}", "trainer.loss.policy_loss=ppo"],
    "gspo": ["aggregation={mode: sample_mean}", "trainer.loss.policy_loss=gspo"],
    "cispo": ["aggregation={mode: token_mean}", "trainer.loss.policy_loss=cispo",
              "trainer.loss.eps_clip_high=4.0"],
    "dr_grpo": ["aggregation={mode: constant, divisor: max_response_len}",
                "trainer.loss.policy_loss=ppo", "rollout.advantage.normalize_std=false"],
}
"""Each recipe's overrides of the config: a row of docs/recipes.md each."""


def eval_accuracy(history: list[dict[str, float]], version: int) -> float:
    """``eval/accuracy`` of the weights of ``version`` (0: the start), NaN when not run."""
    for row in history:
        if row.get("eval/weight_version") == version and "eval/accuracy" in row:
            return row["eval/accuracy"]
    return math.nan


def seconds_per_step(history: list[dict[str, float]]) -> float:
    """Median ``perf/step_time_s`` over the steps after the first (the first pays for
    start-up), or the first's when there is one step."""
    times = [row["perf/step_time_s"] for row in history if "perf/step_time_s" in row]
    if not times:
        return math.nan
    return statistics.median(times[1:] or times)


def run_recipe(config_path: str, name: str, steps: int, ppo_epochs: int,
               overrides: list[str]) -> dict[str, float]:
    """One recipe's job, in a folder of its own that goes when it ends."""
    config = load_job_config(config_path, [
        f"name=recipes-{name.replace('_', '-')}", f"num_steps={steps}",
        f"trainer.ppo_epochs={ppo_epochs}", "checkpoint_every=0", *RECIPES[name],
        *overrides])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        # the driver's progress lines only (one a step), tagged with the recipe
        history = run_job(config, Path(folder) / "job", log=lambda line: print(
            f"[{name}] {line}", flush=True) if str(line).startswith("step ") else None)
    result = {"start": eval_accuracy(history, 0), "final": eval_accuracy(history, steps),
              "s/step": seconds_per_step(history), "wall_s": time.perf_counter() - started,
              "reward": history[-1].get("reward/mean", math.nan)}
    print(f"[{name}] done: {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2-math.yaml"))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--recipes", default=",".join(RECIPES),
                        help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--ppo-epochs", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="a config override for every recipe (key=value)")
    args = parser.parse_args()
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {unknown}; expected some of {list(RECIPES)}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    results = {name: run_recipe(args.config, name, args.steps, args.ppo_epochs,
                                args.overrides) for name in names}
    print(f"{Path(args.config).name}, {args.steps} steps, ppo_epochs {args.ppo_epochs}"
          + (f", {' '.join(args.overrides)}" if args.overrides else ""))
    print(f"{'recipe':<9} {'accuracy start':>15} {'accuracy final':>15} {'s/step':>8} "
          f"{'last reward':>12} {'wall s':>8}")
    for name, r in results.items():
        print(f"{name:<9} {r['start']:>15.3f} {r['final']:>15.3f} {r['s/step']:>8.2f} "
              f"{r['reward']:>12.3f} {r['wall_s']:>8.0f}")


if __name__ == "__main__":
    main()
