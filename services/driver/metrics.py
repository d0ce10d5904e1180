"""What one rollout step logs (metrics.jsonl's row), and the progress line it prints.

A rollout step trains ``num_updates_per_rollout`` optimizer steps; each optimizer step's
J is exact for its own mini-batch (trainer/objective.py). The rollout's row holds their
mean (min/max of a few), the rollout's own statistics, timings, and the share of weight
each aggregation mode gives to short, middle and long responses (docs/glossary.md).
"""

from __future__ import annotations

from rollout.batch import RolloutBatch
from services.driver.pipeline import WALL_CLOCK_METADATA
from trainer.aggregation import LENGTH_BUCKETS, length_bias

SPREAD_METRICS = ("pg_loss", "clip_fraction", "kl", "grad_norm", "ratio/mean_abs_dev")
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
    out |= {k: max(u[k] for u in taken) for k in names if k.startswith("perf/peak_")}
    for name in SPREAD_METRICS:
        out[f"{name}/min"] = min(u[name] for u in taken)
        out[f"{name}/max"] = max(u[name] for u in taken)
    out["perf/compute_s"] = sum(u["perf/compute_s"] for u in taken)
    out["lr"] = taken[-1]["lr"]
    return out


def length_bias_metrics(batch: RolloutBatch, constant_divisor: float) -> dict[str, float]:
    """``length_bias/<mode>/<short|middle|long>``: each mode's share of the batch's weight
    on its thirds of responses by valid tokens M_i (trainer.aggregation.length_bias).
    With several optimizer steps per rollout it views the rollout's batch as one step."""
    shares = length_bias(batch.sample_token_counts, batch.group_index, constant_divisor,
                         group_size=batch.samples_per_prompt)
    return {f"length_bias/{mode}/{bucket}": share for mode, by_bucket in shares.items()
            for bucket, share in zip(LENGTH_BUCKETS, by_bucket, strict=True)}


def rollout_metrics(batch: RolloutBatch, per_update: list[dict[str, float]],
                    times: dict[str, float], constant_divisor: float) -> dict[str, float]:
    """Everything the dashboard plots for one rollout step; ``constant_divisor`` is the L
    of the constant mode's metrics (ObjectiveConfig.mode_metric_divisor)."""
    step_time = sum(times.values())
    num_tokens = float(batch.sequence_lengths.sum())
    return {
        **{k: float(v) for k, v in batch.metadata.items() if k not in WALL_CLOCK_METADATA},
        **optimizer_steps_summary(per_update),
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std()) if batch.num_samples > 1 else 0.0,
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
    return {"skipped": 1.0, "reward/mean": float(batch.rewards.mean())}


def progress_line(step: int, num_steps: int, history: list[dict[str, float]]) -> str:
    """``step 3/20 | reward … | pg_loss … | tok/s | s | padding [| updates] [| eval]``."""
    metrics = history[-1]
    head = f"step {step + 1}/{num_steps}"
    evaluated = (f" | eval accuracy {metrics['eval/accuracy']:.3f}"
                 + (f" pass@{metrics['eval/k']:.0f} {metrics['eval/pass@k']:.3f}"
                    if "eval/pass@k" in metrics else "")
                 + f" (weights {metrics['eval/weight_version']:.0f})"
                 if "eval/accuracy" in metrics else "")
    if metrics.get("skipped") or not metrics.get("updates", 1):
        return f"{head} | skipped: no valid token in the batch" + evaluated
    recent = [m["reward/mean"] for m in history[-10:]]
    return (f"{head} | reward {metrics['reward/mean']:.3f} "
            f"(last 10: {sum(recent) / len(recent):.3f}) "
            f"| pg_loss {metrics['pg_loss']:+.4f} | {metrics['perf/tokens_per_s']:,.0f} tok/s "
            f"| {metrics['perf/step_time_s']:.1f} s "
            f"| padding {metrics.get('padding_fraction', 0.0):.1%}"
            + (f" | {metrics['updates']:.0f} updates, clip ≤ {metrics['clip_fraction/max']:.3f}"
               if metrics.get("updates", 1) > 1 else "")
            + (f" ({metrics['updates/skipped']:.0f} skipped: no valid token)"
               if metrics.get("updates/skipped") else "")
            + evaluated)
