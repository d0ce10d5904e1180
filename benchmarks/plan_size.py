"""What the step plan ships to every rank per step: per-sample coefficients (now) against
the dense float64 [N, S] weights of one tensor per term (before), at N=512, S=8192.

    python benchmarks/plan_size.py [--num-samples 512] [--seq-len 8192]
"""

from __future__ import annotations

import argparse
import pickle
import time

import torch

from rollout.batch import RolloutBatch
from trainer.aggregation import token_weights
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.step_plan import plan_step


def synthetic_batch(num_samples: int, seq_len: int, group_size: int = 8) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    prompt_len = 256
    lengths = torch.randint(16, seq_len - prompt_len + 1, (num_samples,), generator=gen)
    lengths[0] = seq_len - prompt_len  # the longest sets S
    prompts = [[1] * prompt_len for _ in range(num_samples)]
    responses = [[5] * int(n) for n in lengths]
    log_probs = [[-1.0] * int(n) for n in lengths]
    rewards = torch.rand(num_samples, generator=gen).tolist()
    return RolloutBatch.from_samples(prompts, responses, log_probs, rewards, rewards,
                                   [i // group_size for i in range(num_samples)], group_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-samples", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()
    batch = synthetic_batch(args.num_samples, args.seq_len)
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 1024, 1.0)
    started = time.perf_counter()
    plan = plan_step(batch, objective, dp_size=8, cp_size=1, max_tokens_per_micro_batch=16384)
    plan_s = time.perf_counter() - started
    now = len(pickle.dumps(plan, protocol=5))
    # Before: one dense float64 [N, S] tensor per term (pg, kl, entropy, four modes).
    started = time.perf_counter()
    dense = {term: token_weights(batch.loss_mask, batch.group_index) for term in plan.terms}
    dense_s = time.perf_counter() - started
    before = len(pickle.dumps(dense, protocol=5))
    print(f"N={batch.num_samples} S={batch.input_ids.shape[1]} terms={len(plan.terms)}")
    print(f"{'':<28}{'bytes per step':>16}{'build s':>10}")
    print(f"{'before: dense [N, S] weights':<28}{before:>16,}{dense_s:>10.3f}")
    print(f"{'now: coefficients c_i [N]':<28}{now:>16,}{plan_s:>10.3f}")
    print(f"ratio {before / now:,.0f}x smaller")


if __name__ == "__main__":
    main()
