"""The calculator environment's step on SmolLM2, KV kept across turns against re-prefill
(``rollout.engine.prefix_cache_mb`` 2048 vs 0), side by side in one run:

1. **Generation** (in-process, one torch engine per setting, configs/smollm2-calculator.yaml's
   records, sampling and environment; the same records and seeds for both, alternated
   step by step): seconds of generation per step's episodes, context tokens prefilled
   and kept, and the ratio. Tokens and log-probs agree between the two (checked).
2. **End to end** (the same config as a real job: Ray, FSDP DP 2, evaluation off; jobs of
   the two settings alternated): time per step, generation and fwd+bwd (fastest and
   median of the steps after each job's first), and the ratio. Both settings play the
   same episodes (their policy tokens per step are printed). Target (issue 40): the step
   time at least halved.

    .venv/bin/python benchmarks/env_turns.py [--steps 4] [--e2e-steps 3] [--e2e-rounds 2]
        [--skip-e2e]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rollout.datasets import load_prompt_dataset
from rollout.engines.base import EpisodeTurn, Generation
from rollout.engines.torch_engine import TorchEngine
from rollout.episodes import Episode, run_episodes
from rollout.tiny import resolve_model_path
from rollout.turns import TurnFormat
from services.config.job import JobConfig, load_job_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2-calculator.yaml"
SETTINGS = {"kept KV": 2048, "re-prefill": 0}
"""Name -> rollout.engine.prefix_cache_mb."""


def play_step(engine: TorchEngine, turns: TurnFormat, config: JobConfig, step: int
              ) -> tuple[float, list[Episode]]:
    """(generation seconds, the episodes) of one step's records, as the manager plays
    them: every live episode generates each turn, the turn said to the engine."""
    rollout = config.rollout
    assert rollout.environment is not None
    environment = rollout.environment
    group = rollout.n_samples_per_prompt
    num_prompts = rollout.rollout_batch_size or rollout.global_batch_size // group
    records = load_prompt_dataset(rollout.dataset)
    taken = records[step * num_prompts:(step + 1) * num_prompts]

    def generate(contexts: list[list[int]], max_new_tokens: int, turn: int
                 ) -> list[Generation]:
        seed = int.from_bytes(hashlib.sha256(f"{step}:{turn}".encode()).digest()[:4])
        sampling = rollout.sampling.model_copy(update={"max_new_tokens": max_new_tokens})
        return engine.generate(contexts, sampling, seed, turn=EpisodeTurn(
            f"bench:{step}", turn, turn + 1 == environment.max_turns))

    started = time.perf_counter()
    episodes, env_seconds = run_episodes(
        [{"prompt": r.prompt, "label": r.label, "metadata": dict(r.metadata)}
         for r in taken for _ in range(group)],
        environment, turns, generate, rollout.sampling.max_new_tokens, lambda ids, i: ids)
    return time.perf_counter() - started - env_seconds, episodes


def _log_prob_gap(one: Episode, other: Episode) -> float:
    """The largest log-prob difference of two episodes before their first differing
    token. They part where a draw falls in the long tail of small tokens, whose
    cumulative mass a 1e-5 difference in log-probs moves past the uniform (the two
    prefills of a 30-layer model round differently: each is ~1e-5 from a teacher-forced
    pass)."""
    ids = list(zip(one.response_ids, other.response_ids, strict=False))
    end = next((i for i, (a, b) in enumerate(ids) if a != b), len(ids))
    if end == 0:
        return 0.0
    return float((torch.tensor(one.log_probs[:end])
                  - torch.tensor(other.log_probs[:end])).abs().max())


def generation_table(steps: int) -> None:
    config = load_job_config(CONFIG, [])
    path = resolve_model_path(config.rollout.model)
    engines = {name: TorchEngine(config.rollout.engine.model_copy(  # type: ignore[union-attr]
        update={"prefix_cache_mb": mb}), path) for name, mb in SETTINGS.items()}
    first = next(iter(engines.values()))
    turns = TurnFormat(first.tokenizer, first.tokenizer.chat_template is not None,
                       config.rollout.environment.observation_role)  # type: ignore[union-attr]
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    worst, num_same, num_episodes = 0.0, 0, 0
    for step in range(steps):
        played = {}
        for name, engine in engines.items():
            spent, played[name] = play_step(engine, turns, config, step)
            seconds[name].append(spent)
        for one, other in zip(*played.values(), strict=True):
            num_same += one.response_ids == other.response_ids
            num_episodes += 1
            worst = max(worst, _log_prob_gap(one, other))
    print(f"\ngeneration (in-process, {steps} steps × "
          f"{config.rollout.global_batch_size} episodes of ≤ "
          f"{config.rollout.environment.max_turns} turns; "  # type: ignore[union-attr]
          f"{num_same}/{num_episodes} episodes token for token the same, log-probs within "
          f"{worst:.1e} up to where they part)")
    print(f"{'':>11} {'s/step':>7} {'median':>7} {'prefilled':>10} {'kept':>9}")
    for name, engine in engines.items():
        print(f"{name:>11} {sum(seconds[name]) / steps:>7.1f} "
              f"{statistics.median(seconds[name]):>7.1f} "
              f"{engine.stats.num_prefilled_tokens:>10,} {engine.stats.num_kept_tokens:>9,}")
    kept, whole = engines["kept KV"].stats, engines["re-prefill"].stats
    print(f"{'ratio':>11} {sum(seconds['re-prefill']) / sum(seconds['kept KV']):>6.2f}× "
          f"{'':>7} {whole.num_prefilled_tokens / max(1, kept.num_prefilled_tokens):>9.1f}×")


def end_to_end_table(steps: int, rounds: int) -> None:
    """Jobs of each setting in turn, ``rounds`` times (a 2-core machine shared with other
    work: alternating spreads its load over both; the fastest step is the least loaded)."""
    from services.driver.loop import run_job

    history: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name, mb in SETTINGS.items():
            with tempfile.TemporaryDirectory() as tmp:
                os.environ.setdefault("TALLY_DATA_DIR", str(Path(tmp) / "data"))
                config = load_job_config(CONFIG, [f"num_steps={steps}", "eval.enabled=false",
                                                  f"rollout.engine.prefix_cache_mb={mb}"])
                rows = run_job(config, Path(tmp) / "job", log=lambda *_: None)[1:]
            history[name] += rows
            print(f"{name}: per step (step s, generation s, fwd+bwd s, policy tokens) "
                  + ", ".join(f"({m['perf/step_time_s']:.1f}, {m['rollout/gen_time_s']:.1f}, "
                              f"{m['perf/compute_s']:.1f}, {m['rollout/gen_tokens']:.0f})"
                              for m in rows), flush=True)
    keys = ("perf/step_time_s", "rollout/gen_time_s", "perf/compute_s")
    print(f"\nend to end ({CONFIG.name}, steps 2..{steps} of {rounds} alternated jobs each; "
          "fastest / median)")
    print(f"{'':>11} {'step s':>13} {'generate':>13} {'fwd+bwd':>13}")
    table = {}
    for name, rows in history.items():
        table[name] = [(min(m[k] for m in rows), statistics.median(m[k] for m in rows))
                       for k in keys]
        print(f"{name:>11} " + " ".join(f"{low:>6.1f} /{mid:>5.1f}" for low, mid in table[name]))
    kept, whole = table["kept KV"], table["re-prefill"]
    print(f"{'ratio':>11} " + " ".join(f"{w[0] / k[0]:>5.2f}× /{w[1] / k[1]:>4.2f}×"
                                        for k, w in zip(kept[:2], whole[:2], strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="in-process generation steps")
    parser.add_argument("--e2e-steps", type=int, default=3, help="steps of each job")
    parser.add_argument("--e2e-rounds", type=int, default=2,
                        help="jobs of each setting, alternated")
    parser.add_argument("--skip-e2e", action="store_true", help="only the generation table")
    args = parser.parse_args()
    torch.set_num_threads(2)
    generation_table(args.steps)
    if not args.skip_e2e:
        end_to_end_table(args.e2e_steps, args.e2e_rounds)


if __name__ == "__main__":
    main()
