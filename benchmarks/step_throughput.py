"""End-to-end tokens/s of an RL step (rollout + train + weight sync) on the tiny model on
CPU, and the share of step time spent outside generation and forward/backward
(orchestration: object store, planning, Ray calls, weight sync, metrics).

Target: overhead under 15% of step time at the demo's batch size.

    .venv/bin/python benchmarks/step_throughput.py [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from services.config import load_job_config
from services.train import run_job

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-sizes", default="64,256")
    args = parser.parse_args()
    print(f"{'batch':>6} {'step s':>7} {'tokens/s':>9} {'generate':>9} {'fwd+bwd':>8} "
          f"{'overhead':>9}")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ.setdefault("TALLY_DATA_DIR", str(Path(tmp) / "data"))
            config = load_job_config(ROOT / "configs" / "demo.yaml", [
                f"num_steps={args.steps}", f"rollout.global_batch_size={batch_size}",
                "warmup.num_steps=60"])
            history = run_job(config, Path(tmp) / "job", log=lambda *_: None)[2:]  # warm
        step = statistics.median(m["perf/step_time_s"] for m in history)
        tokens = statistics.median(m["perf/tokens_per_s"] for m in history)
        generate = statistics.median(m["rollout/gen_time_s"] for m in history)
        compute = statistics.median(m["perf/compute_s"] for m in history)
        overhead = max(0.0, step - generate - compute) / step
        print(f"{batch_size:>6} {step:>7.2f} {tokens:>9,.0f} {generate / step:>9.1%} "
              f"{compute / step:>8.1%} {overhead:>9.1%}")


if __name__ == "__main__":
    main()
