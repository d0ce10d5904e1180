"""What the critic costs per rollout step: the same job as GRPO and as PPO with a critic
(GAE), side by side in one run, through the real driver on Ray.

Both run the config's rollouts (the same seeds: the first rollout is the same prompts and
samples) for ``--steps`` steps; the table prints the median over the steps after the
first of: the step's wall time, the policy's fwd+bwd (``perf/compute_s``), the critic's
(``perf/critic/compute_s``: its values, GAE is on the driver, and its updates), and the
step time ratio. The critic's warm-up is set to 0 so every step has both updates.

    .venv/bin/python benchmarks/critic_cost.py [--config configs/demo-ppo.yaml] [--steps 12]
        [--set key=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from services.config.job import load_job_config
from services.driver.loop import run_job

ROOT = Path(__file__).resolve().parents[1]


def median_after_first(history: list[dict[str, float]], name: str) -> float:
    values = [row[name] for row in history[1:] if name in row]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo-ppo.yaml"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    common = [f"num_steps={args.steps}", "eval.enabled=false", "checkpoint_every=0",
              *args.overrides]
    settings = {
        "GRPO": [*common, "rollout.advantage={type: grpo}", "critic.enabled=false"],
        "PPO + critic": [*common, "critic.warmup_steps=0"],
    }
    rows = []
    for name, overrides in settings.items():
        config = load_job_config(args.config, overrides)
        with tempfile.TemporaryDirectory() as folder:
            history = run_job(config, Path(folder) / "job", log=lambda *_: None)
        rows.append((name, median_after_first(history, "perf/step_time_s"),
                     median_after_first(history, "perf/compute_s"),
                     median_after_first(history, "perf/critic/compute_s"),
                     history[-1]["reward/mean"]))
    base = rows[0][1]
    print(f"{args.config}, {args.steps} steps, medians over steps 1..{args.steps - 1}")
    print(f"{'setting':<14} {'s/step':>8} {'policy fwd+bwd s':>17} {'critic s':>9} "
          f"{'× GRPO step':>12} {'last reward':>12}")
    for name, step, policy, critic, reward in rows:
        print(f"{name:<14} {step:>8.3f} {policy:>17.3f} {critic:>9.3f} {step / base:>12.2f} "
              f"{reward:>12.3f}")


if __name__ == "__main__":
    main()
