r"""Evaluation during training: when it runs, and what it reports.

The rollout manager generates and scores (``RolloutManager.evaluate``); this module turns
its outcomes into the logged metrics. For a held-out prompt with n sampled responses of
which c are correct, the unbiased pass@k estimator (Chen et al., 2021) is

    pass@k = 1 − C(n − c, k) / C(n, k)          (1 when n − c < k)

averaged over prompts; greedy accuracy is the fraction of prompts whose greedy response
is correct. A response is correct when its reward is at least ``eval.correct_reward``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from rollout.manager import EvalOutcome
from services.config import EvalConfig


def is_eval_step(step: int, num_steps: int, config: EvalConfig) -> bool:
    """Before the first step, every ``every_steps`` steps, and at the last step."""
    return config.enabled and (step % config.every_steps == 0 or step == num_steps - 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (the formula above)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(outcomes: Sequence[EvalOutcome], config: EvalConfig) -> dict[str, float]:
    """``eval/accuracy``, ``eval/pass@k`` (k in ``eval/k``), the greedy responses' mean
    length, and the accuracy per difficulty level when the prompts have one."""
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
    by_level: dict[str, list[bool]] = defaultdict(list)
    for outcome, ok in zip(outcomes, correct, strict=True):
        if "difficulty" in outcome.metadata:
            by_level[str(outcome.metadata["difficulty"])].append(ok)
    for level, oks in sorted(by_level.items()):
        metrics[f"eval/accuracy/d{level}"] = sum(oks) / len(oks)
    return metrics
