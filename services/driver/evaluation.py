r"""Evaluation during training: its config, when it runs, what it measures, what it logs.

The rollout manager generates and scores held-out prompts (``RolloutManager.evaluate``);
this module decides which weights to evaluate and turns the outcomes into metrics. For a
held-out prompt with n sampled responses of which c are correct, the unbiased pass@k
estimator (Chen et al., 2021) is

    pass@k = 1 − C(n − c, k) / C(n, k)          (1 when n − c < k)

averaged over prompts; greedy accuracy is the fraction of prompts whose greedy response
is correct (reward ≥ ``eval.correct_reward``).

Which weights: version v = the rollout steps trained into them. Evaluated are v = 0 (the
start), every ``every_steps``, and v = num_steps — the final trained weights, after the
last step — whose metrics go in the last step's row (the start of the last step is not
evaluated separately: the final weights stand for it). ``eval/weight_version`` in the row
is the manager's own word for what it measured. An evaluation queues in the manager
behind the load of its weights, so it measures exactly version v; with
``rollout.async_steps`` that load queues behind the rollouts already asked for, so the
driver does not wait: it collects the result at the end of a later step (and waits only
at the end of the job). Every result also goes to ``eval.jsonl`` keyed by v.

``tally eval CHECKPOINT --config CONFIG`` (:func:`evaluate_checkpoint`) evaluates the
weights of checkpoint ``step_N`` — version N + 1 — the same way, without training.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.driver.config import EvalConfig

if TYPE_CHECKING:
    from rollout.manager import EvalOutcome, EvalRun
    from services.config.job import JobConfig


def is_eval_version(version: int, num_steps: int, config: EvalConfig) -> bool:
    """Evaluate weights ``version`` (0 … num_steps)? The start, every ``every_steps``, the
    final weights; not the start of the last step (its row holds the final weights')."""
    if not config.enabled:
        return False
    return version == num_steps or (version % config.every_steps == 0
                                    and version < num_steps - 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (the formula above)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(outcomes: Sequence[EvalOutcome], config: EvalConfig) -> dict[str, float]:
    """``eval/accuracy``, ``eval/pass@k`` (k in ``eval/k``), the greedy responses' mean
    length, the accuracy per difficulty level when the prompts have one, and with several
    reward parts each part's mean over the greedy responses (``eval/reward/<name>/mean``)."""
    if not outcomes:
        raise ValueError("eval.dataset: no held-out prompts to evaluate")
    correct = [o.greedy_reward >= config.correct_reward for o in outcomes]
    metrics = {"eval/accuracy": sum(correct) / len(outcomes),
               "eval/reward_mean": sum(o.greedy_reward for o in outcomes) / len(outcomes),
               "eval/response_length": sum(o.greedy_length for o in outcomes) / len(outcomes),
               "eval/num_prompts": float(len(outcomes))}
    if config.num_samples:
        k = config.pass_k
        metrics["eval/pass@k"] = sum(
            pass_at_k(len(o.sample_rewards),
                      sum(r >= config.correct_reward for r in o.sample_rewards), k)
            for o in outcomes) / len(outcomes)
        metrics["eval/k"] = float(k)
    greedy_parts = [o.samples[0].rewards for o in outcomes if o.samples]
    if len(greedy_parts) == len(outcomes) and len(greedy_parts[0]) > 1:  # several parts
        for name in greedy_parts[0]:  # e.g. a rule's correctness beside a reward model
            values = [p[name] for p in greedy_parts if p[name] is not None]  # unscored: out
            if values:
                metrics[f"eval/reward/{name}/mean"] = sum(values) / len(values)
    by_level: dict[str, list[bool]] = defaultdict(list)
    for outcome, ok in zip(outcomes, correct, strict=True):
        if "difficulty" in outcome.metadata:
            by_level[str(outcome.metadata["difficulty"])].append(ok)
    for level, oks in sorted(by_level.items()):
        metrics[f"eval/accuracy/d{level}"] = sum(oks) / len(oks)
    return metrics


class Evaluation:
    """Evaluations asked of the rollout manager and not yet logged, oldest first."""

    def __init__(self, config: EvalConfig, num_steps: int, ask: Callable[[int], Any],
                 fetch: Callable[[Any], EvalRun], is_ready: Callable[[Any], bool],
                 record: Callable[[int, dict[str, float]], None],
                 record_samples: Callable[[list[dict]], None] = lambda _: None) -> None:
        """``ask(version)``: the manager's evaluate call, a reference; ``fetch(ref)``: its
        answer (bounded wait); ``is_ready(ref)``: answered yet; ``record(version,
        metrics)``: every result's own row (eval.jsonl); ``record_samples``: its samples
        as text (samples.jsonl)."""
        self.config, self.num_steps = config, num_steps
        self.ask, self.fetch, self.is_ready, self.record = ask, fetch, is_ready, record
        self.record_samples = record_samples
        self.pending: list[tuple[int, Any, float]] = []

    def start(self, version: int) -> None:
        """Ask for the evaluation of weights ``version`` when it is due (queued in the
        manager after their load)."""
        if is_eval_version(version, self.num_steps, self.config):
            self.pending.append((version, self.ask(version), time.perf_counter()))

    def collect(self, wait: bool) -> dict[str, float]:
        """The newest finished evaluation's metrics for this row ({} when none finished;
        ``wait``: wait for all of them); every finished one is recorded. ``perf/eval_s``
        runs from the request to the answer (with async, queueing included)."""
        row: dict[str, float] = {}
        while self.pending and (wait or self.is_ready(self.pending[0][1])):
            version, ref, started = self.pending.pop(0)
            run = self.fetch(ref)
            row = {**eval_metrics(run.outcomes, self.config),
                   "eval/weight_version": float(run.weight_version),
                   "perf/eval_s": time.perf_counter() - started}
            self.record(version, row)
            self.record_samples([s for outcome in run.outcomes for s in outcome.samples])
        return row


def evaluate_checkpoint(config: JobConfig, checkpoint: str | Path,
                        log: Callable[[str], None] = lambda _: None) -> dict[str, float]:
    """``tally eval``: the eval section of ``config`` on a checkpoint's weights, no
    training. The checkpoint is exported (float32, the trained weights) to a temporary
    Hugging Face folder that a rollout manager loads as its model; the evaluation runs
    with the seeds of weight version v = step + 1, so it measures what the job's own
    evaluation of those weights did. Starts (and stops) Ray if none runs; ExportError
    for a folder that is not a readable checkpoint."""
    import tempfile

    import ray

    from services.runtime.gang import Gang, Roles, ray_started
    from services.runtime.quiet import quiet_transformers
    from trainer.checkpoint import checkpoint_step
    from trainer.checkpoint_check import unreadable
    from trainer.export import ExportError, export_checkpoint

    folder = Path(checkpoint).resolve()  # a `latest` link names its target
    if reason := unreadable(folder):
        raise ExportError(f"{checkpoint}: not a readable checkpoint ({reason})")
    version = checkpoint_step(folder) + 1
    quiet_transformers()
    eval_config = config.eval
    # the engines, reward actors and manager only: no ranks, so nothing is placed
    roles = Roles(engines=True, reward_actors=True, manager=True, place=False)
    with tempfile.TemporaryDirectory(prefix="tally-eval-") as tmp:
        model_path = str(export_checkpoint(folder, Path(tmp) / "model"))
        with ray_started(os.cpu_count() or 1), Gang(config, model_path, roles) as gang:
            run = ray.get(gang.manager.evaluate.remote(
                config.eval_dataset(), eval_config.num_prompts, eval_config.num_samples,
                eval_config.temperature or config.rollout.sampling.temperature, version))
    log(f"evaluated {folder.name} (weight version {version})")
    return {**eval_metrics(run.outcomes, eval_config), "eval/weight_version": float(version)}
