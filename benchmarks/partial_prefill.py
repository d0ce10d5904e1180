"""What continuing a paused sample costs: KV kept between the rounds of a version against
re-prefilling every context (issue 53), beside the synchronous reference, in one process.

One in-process torch engine per mode, all three decoding the same model object (same
weights), the same prompts in the same order, the same seeds per (step, round):

    (a) kept KV     rollout.partial's pool (PartialRollouts.take) decoded as the manager's
                    ``_take_partial`` does: contexts = prompt + tokens so far, one engine
                    call per round with EpisodeTurn("partial", round, last=False), chunks of
                    partial_chunk_tokens; prefix_cache_mb at its default, so each row's KV
                    is kept from one round to the next; the weights are reloaded before
                    every step, as a job's sync does, so each step's first round prefills
                    every context in flight again
    (b) prefix off  the same with prefix_cache_mb 0: every round prefills every context
    (c) whole       no pause: each step's P × G samples in one generate call of
                    max_new_tokens (the synchronous reference; weights reloaded too)

The workload has a long tail: the model's EOS logit is lifted by a constant (lm_head given
a bias, calibrated so that EOS has probability ``--eos-prob`` on average over random text)
so response lengths are about geometric, cut at max_new_tokens. Prompts are random words.

Per step and mode: engine seconds (the generate calls only: weight loads excluded, one
warm-up call per engine before step 0 excluded), of them the prefill's (the engine's
``_prefill`` timed) and of those the step's first call's (after the weight load: every
context in flight prefilled again; the rest is the rounds' last tokens and the copying of
kept KV into each round's batch), tokens decoded, context tokens prefilled and kept
(TorchEngine.stats), and two overheads over (c), in % of (c)'s engine seconds per
decoded token (the modes decode different samples in a step: the pool's calls decode
every sample in flight, taken or not):

    re-prefill  (prefill s / decoded token of the mode − (c)'s) / (c)'s s per decoded token:
                the extra prefill alone (a later round's prefill of a row's last token
                stands for the decode step (c) makes for it: counted here, it is the
                forward either way; the rest of it is copying kept KV into the batch)
    all         (s / decoded token of the mode) / (c)'s − 1: everything continuing
                changes, the re-prefill and more calls, but also fuller batches (a round
                decodes every sample in flight, where (c)'s tail decodes a few rows alone)

The last lines: totals, the response-length tail, and whether
(a) and (b) sampled the same tokens (they should: keeping KV never changes what is
sampled, up to float rounding of the two prefills).

    .venv/bin/python benchmarks/partial_prefill.py [--model tiny|smollm2] [--steps 10]
        [--prompts 8] [--group 4] [--prompt-tokens 128] [--max-new-tokens 64]
        [--chunk-tokens 8] [--eos-prob 0.04] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import AutoModelForCausalLM

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.base import EpisodeTurn, Generation
from rollout.engines.torch_engine import TorchEngine
from rollout.partial import PARTIAL_EPISODES, PartialRollouts, PartialStats
from rollout.pretrained import SMOLLM2_NAME
from rollout.tiny import resolve_model_path

MODELS = {"tiny": "tiny", "smollm2": SMOLLM2_NAME}
ASYNC_STEPS = 1
"""k: the pool holds (1 + k) · P groups, and the default staleness bound follows from it."""


class TimedEngine(TorchEngine):
    """The torch engine with its prefills timed (the call itself unchanged)."""

    prefill_s = 0.0

    def _prefill(self, *args: Any, **kwargs: Any) -> Any:
        _sync(self.device)
        started = time.perf_counter()
        out = super()._prefill(*args, **kwargs)
        _sync(self.device)
        self.prefill_s += time.perf_counter() - started
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Measure:
    """One mode's step: what its engine calls cost."""

    seconds: float = 0.0
    prefill_s: float = 0.0
    load_prefill_s: float = 0.0
    """Of prefill_s, the step's first call's (the first round after the weight load,
    which prefills every context in flight whatever is kept)."""
    decoded: int = 0
    prefilled: int = 0
    kept: int = 0

    def __iadd__(self, other: Measure) -> Measure:
        for name in ("seconds", "prefill_s", "load_prefill_s", "decoded", "prefilled",
                     "kept"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


def seed_of(step: int, round_number: int) -> int:
    """As the manager's ``_seed(step, draw, rank)``: the same for every mode."""
    digest = hashlib.sha256(f"0:{step}:{round_number}:0".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class Mode:
    """One engine and its own cursor over the shared prompts; ``step`` plays one step."""

    def __init__(self, engine: TimedEngine, prompts: list[list[int]], args: argparse.Namespace,
                 state: dict[str, torch.Tensor], partial: bool) -> None:
        self.engine, self.prompts, self.args, self.state = engine, prompts, args, state
        self.cursor = 0
        self.sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
        self.pool = (PartialRollouts(
            args.group, args.max_new_tokens, args.chunk_tokens, (1 + ASYNC_STEPS) * args.prompts,
            ASYNC_STEPS - 1 + args.max_new_tokens // args.chunk_tokens) if partial else None)
        self.taken: list[list[list[int]]] = []
        """Per step, the token ids of every sample taken (group by group)."""

    def admit(self, count: int) -> list[tuple[int, list[int]]]:
        taken = [(i, self.prompts[i]) for i in range(self.cursor, self.cursor + count)]
        self.cursor += count
        return taken

    def _call(self, contexts: list[list[int]], sampling: SamplingConfig, seed: int,
              turn: EpisodeTurn | None, measure: Measure) -> list[Generation]:
        engine = self.engine
        prefilled, kept = engine.stats.num_prefilled_tokens, engine.stats.num_kept_tokens
        prefill_s = engine.prefill_s
        _sync(engine.device)
        started = time.perf_counter()
        generations = engine.generate(contexts, sampling, seed, turn=turn)
        _sync(engine.device)
        if measure.seconds == 0.0:  # the step's first call
            measure.load_prefill_s = engine.prefill_s - prefill_s
        measure.seconds += time.perf_counter() - started
        measure.prefill_s += engine.prefill_s - prefill_s
        measure.prefilled += engine.stats.num_prefilled_tokens - prefilled
        measure.kept += engine.stats.num_kept_tokens - kept
        measure.decoded += sum(len(g.token_ids) for g in generations)
        return generations

    def step(self, step: int) -> Measure:
        self.engine.update_weights(self.state)  # a job's sync: the kept KV goes (untimed)
        measure = Measure()
        if self.pool is None:  # (c): the step's samples whole, in one call
            contexts = [ids for _, ids in self.admit(self.args.prompts)
                        for _ in range(self.args.group)]
            generations = self._call(contexts, self.sampling, seed_of(step, 0), None, measure)
            self.taken.append([g.token_ids for g in generations])
            return measure
        chunk = self.sampling.model_copy(update={"max_new_tokens": self.args.chunk_tokens})

        def decode(contexts: list[list[int]], round_number: int) -> list[Generation]:
            # as rollout/manager.py _take_partial builds it
            version = self.engine.weight_version
            generations = self._call(contexts, chunk, seed_of(step, round_number),
                                     EpisodeTurn(PARTIAL_EPISODES, round_number, last=False),
                                     measure)
            return [dataclasses.replace(g, versions=[version] * len(g.token_ids))
                    for g in generations]

        self.pool.drop_stale(step)
        groups = self.pool.take(self.args.prompts, self.admit, decode, PartialStats())
        self.taken.append([s.tokens for g in groups for s in g.samples])
        return measure


def eos_prone(model: torch.nn.Module, eos_id: int, probability: float,
              contexts: list[list[int]]) -> float:
    """Give lm_head (untied) a bias lifting the EOS logit so that EOS has ``probability``
    on average over the positions of ``contexts``; returns the bias."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(contexts, device=model.device)).logits.float()
        logits = logits.flatten(0, 1)
        eos = logits[:, eos_id]
        others = torch.cat([logits[:, :eos_id], logits[:, eos_id + 1:]], dim=1).logsumexp(-1)
        low, high = -50.0, 50.0
        for _ in range(60):  # bisection: the mean probability grows with the bias
            bias = (low + high) / 2
            mean = torch.sigmoid(eos + bias - others).mean().item()
            low, high = (bias, high) if mean < probability else (low, bias)
        head = model.lm_head
        biased = torch.nn.Linear(head.in_features, head.out_features, bias=True,
                                 device=head.weight.device, dtype=head.weight.dtype)
        biased.weight = torch.nn.Parameter(head.weight.detach().clone())
        biased.bias.zero_()
        biased.bias[eos_id] = bias
    model.lm_head = biased.requires_grad_(False)
    model.config.tie_word_embeddings = False
    return bias


def random_prompts(tokenizer: Any, count: int, num_tokens: int, seed: int) -> list[list[int]]:
    """``count`` prompts of exactly ``num_tokens`` ids: random lowercase words."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < num_tokens:
            words = " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz",
                                                 k=rng.randint(2, 8))) for _ in range(16))
            ids += tokenizer.encode(" " + words, add_special_tokens=False)
        prompts.append(ids[:num_tokens])
    return prompts


def overhead(mode: Measure, whole: Measure) -> float:
    """All that continuing changes: % of engine time per decoded token over (c)'s."""
    return 100 * ((mode.seconds / max(mode.decoded, 1))
                  / (whole.seconds / max(whole.decoded, 1)) - 1)


def re_prefill(mode: Measure, whole: Measure) -> float:
    """The prefill's part of it: prefill seconds per decoded token beyond (c)'s, in % of
    (c)'s engine seconds per decoded token."""
    return 100 * ((mode.prefill_s / max(mode.decoded, 1))
                  - (whole.prefill_s / max(whole.decoded, 1))) / (
                      whole.seconds / max(whole.decoded, 1))


def row(name: str, m: Measure, whole: Measure) -> str:
    if m.decoded == 0:  # the pool held P done groups already: the step took them, no call
        return f"{name:>16} {'no engine call: P groups were done in the pool':>40}"
    return (f"{name:>16} {m.seconds:>8.3f} {m.prefill_s:>8.3f} {m.load_prefill_s:>8.3f} "
            f"{100 * m.prefill_s / max(m.seconds, 1e-9):>6.1f}% {m.decoded:>8,} "
            f"{m.prefilled:>10,} {m.kept:>9,} {1000 * m.seconds / max(m.decoded, 1):>7.3f} "
            f"{re_prefill(m, whole):>+9.1f}% {overhead(m, whole):>+8.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=8, help="P: groups a step takes")
    parser.add_argument("--group", type=int, default=4, help="G: samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=8,
                        help="partial_chunk_tokens (its default: max_new_tokens / 8)")
    parser.add_argument("--eos-prob", type=float, default=0.04,
                        help="mean EOS probability per token (geometric lengths, mean ≈ 1/p)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.max_new_tokens % args.chunk_tokens:
        parser.error(f"--chunk-tokens {args.chunk_tokens} must divide --max-new-tokens "
                     f"{args.max_new_tokens}")
    torch.set_num_threads(args.threads)
    path = resolve_model_path(MODELS[args.model])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device)
    base = TorchEngineConfig(device=args.device)
    kept_engine = TimedEngine(base, path, model=model)
    prompts = random_prompts(kept_engine.tokenizer, (2 + ASYNC_STEPS) * args.prompts
                             * (args.steps + 2), args.prompt_tokens, seed=0)
    bias = eos_prone(model, kept_engine.eos_ids[0], args.eos_prob, prompts[:8])
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    engines = {"(a) kept KV": kept_engine,
               "(b) prefix 0": TimedEngine(base.model_copy(update={"prefix_cache_mb": 0}),
                                           path, model=model),
               "(c) whole": TimedEngine(base, path, model=model)}
    for engine in engines.values():  # warm-up, excluded
        engine.generate(prompts[-2:], SamplingConfig(max_new_tokens=8), 1)
        engine.stats.num_prefilled_tokens = engine.stats.num_kept_tokens = 0
        engine.prefill_s = 0.0
    modes = {name: Mode(engine, prompts, args, state, partial=name != "(c) whole")
             for name, engine in engines.items()}
    print(f"model {args.model}, {args.threads} thread(s) on {args.device}; P={args.prompts} "
          f"× G={args.group}, prompts of {args.prompt_tokens} tokens, max_new_tokens "
          f"{args.max_new_tokens}, chunk {args.chunk_tokens}, pool (1 + {ASYNC_STEPS})·P "
          f"groups; EOS bias {bias:+.2f} (mean p {args.eos_prob})")
    print(f"{'step  mode':>16} {'engine s':>8} {'prefill':>8} {'1st call':>8} {'share':>7} "
          f"{'decoded':>8} "
          f"{'prefilled':>10} {'kept':>9} {'ms/tok':>7} {'re-prefill':>10} {'all':>9}")
    totals = {name: Measure() for name in modes}
    names = list(modes)
    for step in range(args.steps):
        # rotated each step: a shared machine's load falls on every mode alike
        order = names[step % 3:] + names[:step % 3]
        measures = {name: modes[name].step(step) for name in order}
        for name in names:
            totals[name] += measures[name]
            print(row(f"{step}  {name}", measures[name], measures["(c) whole"]))
    print("total")
    for name in names:
        print(row(name, totals[name], totals["(c) whole"]))
    lengths = [len(t) for step in modes["(c) whole"].taken for t in step]
    print(f"(c)'s responses: mean {statistics.mean(lengths):.1f} tokens, median "
          f"{statistics.median(lengths):.0f}, p90 {sorted(lengths)[9 * len(lengths) // 10]}, "
          f"max {max(lengths)}; {sum(n == args.max_new_tokens for n in lengths)}/"
          f"{len(lengths)} at max_new_tokens")
    a, b = modes["(a) kept KV"].taken, modes["(b) prefix 0"].taken
    same = sum(x == y for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))
    print(f"(a) and (b) sampled the same tokens: {same}/{sum(len(s) for s in a)} samples taken")
    kept, off, whole = (totals[name] for name in names)
    print(f"RE_PREFILL_OVERHEAD kept_kv={re_prefill(kept, whole):+.1f}% "
          f"prefix_off={re_prefill(off, whole):+.1f}% (all: {overhead(kept, whole):+.1f}% "
          f"and {overhead(off, whole):+.1f}%) of (c)'s engine time per decoded token; "
          f"{100 * kept.load_prefill_s / max(kept.prefill_s, 1e-9):.0f}% of (a)'s prefill "
          "seconds in each step's first call")


if __name__ == "__main__":
    main()
