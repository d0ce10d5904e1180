"""The CPU trainer path of one rank: forward + backward (``FSDPWorker.forward_backward``,
slicing, row layout, attention, loss) on the tiny model in fp32, for packed rows sharing
each group's prompt (the default), packed rows sharing nothing, and padding.

Two workloads: ``verify`` (test_verify's test_every_update batch: 16 short samples, rows
of 12 tokens) and ``long`` (8 groups × 8 samples, 48-token prompts, 16-96-token
responses, rows of 1024 tokens). With ``--trees A B`` each source tree (e.g. a checkout
of the commit before a change, and this one) runs in its own process, alternating
rounds; times are the rank's CPU time (``time.process_time``: one thread, so a busy
machine's waiting is left out), each tree's best, and B / A.

    .venv/bin/python benchmarks/packed_step.py [--trees OLD NEW] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {"shared prefix": (True, True), "packed": (True, False), "padded": (False, False)}


def _batch(vocab: int, workload: str):
    import torch

    from rollout.batch import RolloutBatch

    gen = torch.Generator().manual_seed(3)
    groups, size, prompt_len, response = ((8, 2, (2, 6), (1, 9)) if workload == "verify"
                                          else (8, 8, (48, 49), (16, 97)))
    prompts, responses, group_ids = [], [], []
    for g in range(groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(*prompt_len, (1,),
                                                            generator=gen)),), generator=gen)
        for _ in range(size):
            n = int(torch.randint(*response, (1,), generator=gen))
            prompts.append(prompt.tolist())
            responses.append(torch.randint(3, vocab, (n,), generator=gen).tolist())
            group_ids.append(g)
    n = len(prompts)
    advantages = (torch.rand(n, generator=gen) - 0.5).tolist()
    return RolloutBatch.from_samples(prompts, responses, [[-1.0] * len(r) for r in responses],
                                     [0.0] * n, advantages, group_ids, size)


def child(workloads: list[str], repeats: int) -> dict[str, float]:
    """Best seconds per forward_backward for each (workload, layout), in this process."""
    import torch
    from transformers import AutoConfig

    from rollout.tiny import create_tiny_checkpoint
    from trainer.backends.fsdp.worker import FSDPWorker
    from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig, TrainerConfig
    from trainer.step_plan import plan_step

    torch.set_num_threads(1)
    path = create_tiny_checkpoint(Path(tempfile.mkdtemp()), seed=0)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    loss = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    objective = ObjectiveConfig.compose(AggregationConfig(), loss, 8, 0.7)
    # One rank for every layout (its attention is set up for packed rows; a padded plan
    # then runs the same attention function without a row layout, in both trees).
    worker = FSDPWorker(TrainerConfig(loss=loss), objective, path, 0, total_steps=1)
    worker.setup("127.0.0.1", 0)
    out = {}
    for workload in workloads:
        batch = _batch(vocab, workload)
        budget = 12 if workload == "verify" else 1024
        for name, (packed, shared) in LAYOUTS.items():
            plan = plan_step(batch, objective, 1, 1, budget, packed=packed,
                             shared_prefix=shared)
            times = []
            for _ in range(repeats + 1):  # the first warms up
                started = time.process_time()
                worker.forward_backward(batch, plan)
                times.append(time.process_time() - started)
                worker.discard_gradients()
            out[f"{workload}/{name}"] = min(times[1:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workloads", default="verify,long")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if args.child:
        print(json.dumps(child(workloads, args.repeats)))
        return
    trees = args.trees or [str(Path(__file__).resolve().parents[1])]
    best: dict[str, dict[str, float]] = {tree: {} for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            env = os.environ | {"PYTHONPATH": tree}
            result = subprocess.run(
                [sys.executable, str(Path(tree) / "benchmarks" / "packed_step.py"), "--child",
                 "--workloads", args.workloads, "--repeats", str(args.repeats)],
                env=env, cwd=tree, capture_output=True, text=True, check=True)
            times = json.loads(result.stdout.strip().splitlines()[-1])
            for key, value in times.items():
                best[tree][key] = min(value, best[tree].get(key, float("inf")))
    keys = list(best[trees[0]])
    header = f"{'workload/layout':<22}" + "".join(f"{Path(t).name:>14}" for t in trees)
    print(header + ("   new/old" if len(trees) == 2 else ""))
    for key in keys:
        row = f"{key:<22}" + "".join(f"{best[t][key] * 1e3:>11.1f} ms" for t in trees)
        if len(trees) == 2:
            row += f"   {best[trees[1]][key] / best[trees[0]][key]:.3f}"
        print(row)


if __name__ == "__main__":
    main()
