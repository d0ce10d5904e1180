"""What one rollout step logs (metrics.jsonl's row), the progress line it prints, and the
warning when the rewards give nothing to learn from.

A rollout step trains ``num_updates_per_rollout`` optimizer steps; each optimizer step's
J is exact for its own mini-batch (trainer/objective.py). The rollout's row holds their
mean (min/max of a few), the rollout's own statistics, timings, and the share of weight
each aggregation mode gives to short, middle and long responses (docs/glossary.md).

Rollout steps are numbered from 0 everywhere (docs/glossary.md): row ``step`` s of
metrics.jsonl, TensorBoard's step s, ``checkpoints/step_{s:08d}`` and the progress line
``step s (s+1/N done)``, where N is ``num_steps``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from rollout.batch import RolloutBatch
from services.driver.pipeline import WALL_CLOCK_METADATA
from trainer.aggregation import LENGTH_BUCKETS, length_bias
from trainer.terms import KL, PG, POLICY_TERMS, VALUE

SPREAD_METRICS = (PG.logged, "clip_fraction", KL.logged, "grad_norm", "ratio/mean_abs_dev")
"""Trainer metrics that also get their min and max over a rollout's optimizer steps."""


def optimizer_steps_summary(per_update: list[dict[str, float]]) -> dict[str, float]:
    """A rollout's trainer metrics: the mean over its optimizer steps, min/max of a few,
    compute summed, the last lr, and how many steps were taken and skipped (a mini-batch
    with no valid token is skipped: trainer/group.py never sees it)."""
    taken = [u for u in per_update if not u.get("skipped")]
    out: dict[str, float] = {"updates": float(len(taken)),
                             "updates/skipped": float(len(per_update) - len(taken))}
    if not taken:
        return out
    names = [k for k in taken[0] if k not in ("valid_tokens", "skipped")]
    out |= {k: sum(u[k] for u in taken) / len(taken) for k in names}
    out |= {k: max(u[k] for u in taken) for k in names if "/peak_" in k}
    for name in SPREAD_METRICS:
        if name in taken[0]:  # a critic's warm-up steps have no policy metrics
            out[f"{name}/min"] = min(u[name] for u in taken)
            out[f"{name}/max"] = max(u[name] for u in taken)
    for name in ("perf/compute_s", "perf/critic/compute_s"):
        if name in taken[0]:
            out[name] = sum(u[name] for u in taken)
    for name in ("lr", "critic/lr"):
        if name in taken[0]:
            out[name] = taken[-1][name]
    return out


def critic_metrics(update: dict[str, float]) -> dict[str, float]:
    """A critic update's metrics as the row names them: ``critic/value_loss``,
    ``critic/clip_fraction``, ``critic/values_mean``, ``critic/grad_norm``, ``critic/lr``,
    and its compute time and peak memory under ``perf/critic/…``."""
    return {(f"perf/critic/{name.removeprefix('perf/')}" if name.startswith("perf/")
             else f"critic/{name}"): value for name, value in update.items()
            if name not in ("valid_tokens", "padding_fraction", "perf/trained_tokens")}


def length_bias_metrics(batch: RolloutBatch, constant_divisor: float) -> dict[str, float]:
    """``length_bias/<mode>/<short|middle|long>``: each mode's share of the batch's weight
    on its thirds of responses by valid tokens M_i (trainer.aggregation.length_bias).
    With several optimizer steps per rollout it views the rollout's batch as one step."""
    shares = length_bias(batch.sample_token_counts, batch.group_index, constant_divisor,
                         group_size=batch.samples_per_prompt)
    return {f"length_bias/{mode}/{bucket}": share for mode, by_bucket in shares.items()
            for bucket, share in zip(LENGTH_BUCKETS, by_bucket, strict=True)}


def groups_with_signal(batch: RolloutBatch) -> float:
    """The share of the rollout's prompt groups whose rewards differ: a group whose G
    rewards are all equal has advantage 0 for every sample (GRPO), so it teaches nothing."""
    _, dense = torch.unique(batch.group_index, return_inverse=True)
    num_groups = int(dense.max()) + 1
    scored = batch.scored  # an unscored sample's reward is a placeholder: left out
    highest = torch.full((num_groups,), -torch.inf).scatter_reduce(
        0, dense[scored], batch.rewards.float()[scored], "amax")
    lowest = torch.full((num_groups,), torch.inf).scatter_reduce(
        0, dense[scored], batch.rewards.float()[scored], "amin")
    return float((highest > lowest).float().mean())


def scored_rewards(batch: RolloutBatch) -> torch.Tensor:
    """The rewards of the scored samples (an unscored one's is a placeholder)."""
    return batch.rewards[batch.scored]


def rollout_metrics(batch: RolloutBatch, per_update: list[dict[str, float]],
                    times: dict[str, float], constant_divisor: float) -> dict[str, float]:
    """Everything the dashboard plots for one rollout step; ``constant_divisor`` is the L
    of the constant mode's metrics (ObjectiveConfig.mode_metric_divisor)."""
    step_time = sum(times.values())
    num_tokens = float(batch.sequence_lengths.sum())
    return {
        **{k: float(v) for k, v in batch.metadata.items() if k not in WALL_CLOCK_METADATA},
        **optimizer_steps_summary(per_update),
        "reward/mean": float(scored_rewards(batch).mean()) if batch.scored.any() else 0.0,
        "reward/std": (float(scored_rewards(batch).std())
                       if int(batch.scored.sum()) > 1 else 0.0),
        "reward/groups_with_signal": groups_with_signal(batch),
        "response_length/mean": float(batch.response_lengths.float().mean()),
        "tokens/valid": float(batch.num_valid_tokens),
        "tokens/total": num_tokens,
        "perf/tokens_per_s": num_tokens / max(step_time, 1e-9),
        "perf/step_time_s": step_time,
        **{f"perf/{name}_s": value for name, value in times.items()},
        **length_bias_metrics(batch, constant_divisor),
    }


def skipped_rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    """A rollout with no valid token: nothing to learn from, skipped (never NaN)."""
    return {"skipped": 1.0, "reward/mean": (float(scored_rewards(batch).mean())
                                            if batch.scored.any() else 0.0),
            "reward/groups_with_signal": groups_with_signal(batch)}


def duration(seconds: float) -> str:
    """``42 s``, ``3m05s``, ``2h10m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """The progress line of each rollout step, with the time left: the mean wall-clock
    time of this start's steps so far (generation, training, sync, evaluation and
    checkpoint alike; made when the actors are up) × the steps left."""

    def __init__(self, num_steps: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.num_steps, self.clock = num_steps, clock
        self.started, self.num_done = clock(), 0

    def line(self, step: int, history: list[dict[str, float]]) -> str:
        """``step 3 (4/20 done) | reward … | pg_loss … | kl … | entropy … | lr … | tok/s |
        s | padding [| updates] [| eval] | ETA …``."""
        self.num_done += 1
        left = self.num_steps - 1 - step
        mean = (self.clock() - self.started) / self.num_done
        eta = f" | ETA {duration(mean * left)}" if left > 0 else ""
        return progress_line(step, self.num_steps, history) + eta


def progress_line(step: int, num_steps: int, history: list[dict[str, float]]) -> str:
    """``step 3 (4/20 done) | reward … | pg_loss … | kl … | entropy … | lr … [| value_loss
    … ev …] | tok/s | s | padding [| updates] [| turns, tool calls, env s] [| eval]``:
    step 3 is row 3 of metrics.jsonl."""
    metrics = history[-1]
    head = f"step {step} ({step + 1}/{num_steps} done)"
    evaluated = (f" | eval accuracy {metrics['eval/accuracy']:.3f}"
                 + (f" pass@{metrics['eval/k']:.0f} {metrics['eval/pass@k']:.3f}"
                    if "eval/pass@k" in metrics else "")
                 + f" (weights {metrics['eval/weight_version']:.0f})"
                 if "eval/accuracy" in metrics else "")
    if metrics.get("skipped") or not metrics.get("updates", 1):
        return f"{head} | skipped: no valid token in the batch" + evaluated
    recent = [m["reward/mean"] for m in history[-10:]]
    shown = [(term.logged, term.progress_format) for term in POLICY_TERMS]
    terms = " | ".join(f"{name} {metrics[name]:{spec}}"
                       for name, spec in (*shown, ("distill/reverse_kl", ".4f"), ("lr", ".2e"))
                       if name in metrics)
    policy = f"| {terms} " if PG.logged in metrics else "| critic warm-up (policy waits) "
    value = f"critic/{VALUE.logged}"
    critic = (f"| {VALUE.logged} {metrics[value]:{VALUE.progress_format}} "
              f"ev {metrics['critic/explained_variance']:+.3f} "
              if value in metrics else "")
    return (f"{head} | reward {metrics['reward/mean']:.3f} "
            f"(last 10: {sum(recent) / len(recent):.3f}) "
            f"{policy}{critic}"
            f"| {metrics['perf/tokens_per_s']:,.0f} tok/s "
            f"| {metrics['perf/step_time_s']:.1f} s "
            f"| padding {metrics.get('padding_fraction', 0.0):.1%}"
            + (f" | {metrics['updates']:.0f} updates"
               + (f", clip ≤ {metrics['clip_fraction/max']:.3f}"
                  if "clip_fraction/max" in metrics else "")
               if metrics.get("updates", 1) > 1 else "")
            + (f" ({metrics['updates/skipped']:.0f} skipped: no valid token)"
               if metrics.get("updates/skipped") else "")
            + (f" | turns {metrics['env/turns_mean']:.1f}"
               + (f", tool calls {metrics['env/tool_calls_mean']:.2f}"
                  if "env/tool_calls_mean" in metrics else "")
               + f", env {metrics['env/seconds']:.1f} s"
               + (f", {metrics['env/failures']:.0f} failed" if metrics["env/failures"] else "")
               if "env/turns_mean" in metrics else "")
            + evaluated)


NO_SIGNAL_STEPS = 3
"""Rollout steps in a row with no group whose rewards differ before the job warns."""


class LearningSignalWatch:
    """Says once when ``NO_SIGNAL_STEPS`` rollout steps in a row had no prompt group whose
    rewards differ (``reward/groups_with_signal`` 0): GRPO's advantages are then all zero
    and nothing is learned — usually a reward function that never matches, or an instruct
    model prompted without its chat template."""

    def __init__(self, patience: int = NO_SIGNAL_STEPS) -> None:
        self.patience, self.flat_steps, self.said = patience, 0, False

    def check(self, row: dict[str, float]) -> str | None:
        """The warning, the first time the rule holds; else None."""
        if row.get("reward/groups_with_signal", 1.0) > 0:
            self.flat_steps = 0
            return None
        self.flat_steps += 1
        if self.said or self.flat_steps < self.patience:
            return None
        self.said = True
        return (f"no learning signal: every group has the same reward for "
                f"{self.flat_steps} steps (reward {row.get('reward/mean', 0.0):.3f}); check "
                "the reward function and rollout.apply_chat_template")
