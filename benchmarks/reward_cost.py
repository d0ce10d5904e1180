"""What a learned reward costs per rollout step: the same job rewarded by its rule alone,
by the rule and a reward model, and by the rule and an LLM judge, side by side in one run,
through the real driver on Ray.

The reward model is random-initialised (a small Qwen2 classifier over the policy's
tokenizer: the cost, not the signal, is measured); the judge is the policy's start model
answering greedily. Two engines generate, so the first engine's shard is scored while
the second still generates. The table prints medians over the steps after the first:
the step's wall time, ``perf/reward_s`` (what the rollout waited for rewards after its
last response), ``perf/reward_busy_s`` (the reward actors' own seconds), and the step
time over the rule's.

    .venv/bin/python benchmarks/reward_cost.py [--config configs/demo.yaml] [--steps 8]
        [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from services.config.job import load_job_config
from services.driver.loop import run_job

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.reward_model_folders: the random reward model


def median_after_first(history: list[dict[str, float]], name: str) -> float:
    values = [row[name] for row in history[1:] if name in row]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from rollout.tiny import resolve_model_path
    from tests.reward_model_folders import save_random_reward_model

    common = [f"num_steps={args.steps}", "eval.enabled=false", "checkpoint_every=0",
              "warmup.enabled=false", "rollout.engine.num_engines=2", *args.overrides]
    base = load_job_config(args.config, common)
    policy = resolve_model_path(base.rollout.model)
    rule = base.rollout.reward_parts[0].model_dump(exclude_defaults=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tally-reward-cost-") as tmp:
        folder = save_random_reward_model(Path(tmp) / "rm", policy)
        variants = {
            "rule": [rule],
            "rule + reward model": [rule, {"type": "model", "path": folder, "weight": 0.01,
                                           "num_cpus": 0.5}],
            "rule + judge": [rule, {"type": "judge", "model": policy, "num_cpus": 0.5,
                                    "template": "{prompt}{response}", "parse": r"([0-9])",
                                    "max_new_tokens": 4, "weight": 0.1}],
        }
        for name, parts in variants.items():
            config = load_job_config(args.config, [
                *common, f"rollout.reward={json.dumps(parts)}"])
            history = run_job(config, Path(tmp) / name.replace(" ", ""),
                              log=lambda *_: None)
            rows.append((name, median_after_first(history, "perf/step_time_s"),
                         median_after_first(history, "perf/reward_s"),
                         median_after_first(history, "perf/reward_busy_s")))
    print(f"{'reward':<22}{'s/step':>9}{'reward_s':>10}{'busy_s':>9}{'vs rule':>9}")
    for name, step, waited, busy in rows:
        print(f"{name:<22}{step:>9.3f}{waited:>10.3f}{busy:>9.3f}{step / rows[0][1]:>8.2f}x")


if __name__ == "__main__":
    main()
