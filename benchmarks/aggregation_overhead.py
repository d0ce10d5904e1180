"""Cost of the aggregation (token_weights once per step + the local Σ w·ℓ) against a
forward+backward of the tiny default model on the same tokens, on CPU.

Target: under 1% of the step, growing linearly with tokens.

    .venv/bin/python benchmarks/aggregation_overhead.py [--max-tokens 1048576]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial

import torch
from transformers import AutoModelForCausalLM

from rollout.tiny import create_tiny_checkpoint
from trainer.aggregation import AGGREGATION_MODES, local_weighted_sum, token_weights
from trainer.losses import token_log_probs

SEQ_LEN, GROUP_SIZE, MICRO_BATCH_SEQS = 256, 8, 16


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def aggregation(mask: torch.Tensor, groups: torch.Tensor, losses: torch.Tensor) -> None:
    """All four modes: the per-mode metric costs them all."""
    for mode in AGGREGATION_MODES:
        divisor = float(mask.shape[1]) if mode == "constant" else None
        local_weighted_sum(losses, token_weights(mask, groups, mode, divisor)).backward()


def forward_backward(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    for start in range(0, len(input_ids), MICRO_BATCH_SEQS):
        ids = input_ids[start:start + MICRO_BATCH_SEQS]
        logits = model(input_ids=ids).logits[:, :-1]
        token_log_probs(logits, ids[:, 1:]).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=1 << 20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(create_tiny_checkpoint(tmp))
    vocab = model.config.vocab_size
    print(f"tiny model, sequences of {SEQ_LEN} tokens, groups of {GROUP_SIZE}, CPU "
          f"({torch.get_num_threads()} threads)\n")
    print(f"{'tokens':>9} {'aggregation ms':>15} {'fwd+bwd ms':>11} {'ratio':>8} "
          f"{'agg ns/token':>13}")
    tokens = 1024
    while tokens <= args.max_tokens:
        num_seqs = max(GROUP_SIZE, tokens // SEQ_LEN)
        seq_len = tokens // num_seqs
        gen = torch.Generator().manual_seed(0)
        input_ids = torch.randint(3, vocab, (num_seqs, seq_len), generator=gen)
        lengths = torch.randint(1, seq_len + 1, (num_seqs,), generator=gen)
        mask = (torch.arange(seq_len)[None] < lengths[:, None]).float()
        groups = torch.arange(num_seqs) // GROUP_SIZE
        losses = torch.randn(num_seqs, seq_len, requires_grad=True)

        agg = best_of(partial(aggregation, mask, groups, losses))
        fwd_bwd = best_of(partial(forward_backward, model, input_ids),
                          repeats=1 if tokens > 1 << 17 else 2)
        print(f"{tokens:>9,} {agg * 1e3:>15.2f} {fwd_bwd * 1e3:>11.1f} "
              f"{agg / fwd_bwd:>8.2%} {agg / tokens * 1e9:>13.1f}")
        tokens *= 4


if __name__ == "__main__":
    main()
