"""What a train-rm run says: the progress line of each step, held-out metrics (overall
and per kind of pair) and the scores written at the end.

Steps are numbered from 0 (docs/glossary.md): row ``step`` s of metrics.jsonl is the
progress line ``step s (s+1/N done)``. An evaluation after step s is in row s under
``eval/*``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.driver.metrics import duration
from trainer.bradley_terry import pair_metrics, pair_objective

EVAL_SCORES_FILE = "eval_scores.jsonl"
"""The final model's score of each held-out pair: {"pair", "kind", "chosen", "rejected"}."""


def held_out_metrics(scores: torch.Tensor, kinds: list[str | None],
                     margins: list[float] | None = None,
                     center_rewards_coefficient: float = 0.0) -> dict[str, float]:
    """``eval/loss`` (the training loss: each pair's margin, the centring term with
    coefficient ``center_rewards_coefficient``), ``eval/loss/bradley_terry``,
    ``eval/accuracy``, ``eval/margin``, mean scores, ``eval/score/centring`` and
    ``eval/accuracy/<kind>`` for each kind of pair the file names, from every held-out
    sequence's score [2P] (``margins``: each pair's, None: all 0)."""
    chosen, rejected = scores[0::2], scores[1::2]
    margin = None if margins is None else torch.tensor(margins, dtype=torch.float64)
    _, sums = pair_objective(chosen, rejected, len(kinds), margin=margin,
                             center_coefficient=center_rewards_coefficient)
    metrics = pair_metrics(sums, len(kinds), prefix="eval/")
    correct = (chosen > rejected).double()
    for kind in sorted({k for k in kinds if k is not None}):
        mine = torch.tensor([k == kind for k in kinds])
        metrics[f"eval/accuracy/{kind}"] = float(correct[mine].mean())
    return metrics


def write_eval_scores(path: Path, scores: torch.Tensor, kinds: list[str | None]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for p, kind in enumerate(kinds):
            out.write(json.dumps({"pair": p, "kind": kind, "chosen": float(scores[2 * p]),
                                  "rejected": float(scores[2 * p + 1])}) + "\n")


def eval_summary(metrics: dict[str, float]) -> str:
    """``eval accuracy 0.810 loss 0.452 [(kind 0.95, …)]``."""
    kinds = ", ".join(f"{name.removeprefix('eval/accuracy/')} {value:.2f}"
                      for name, value in metrics.items() if name.startswith("eval/accuracy/"))
    return (f"eval accuracy {metrics['eval/accuracy']:.3f} loss {metrics['eval/loss']:.4f}"
            + (f" ({kinds})" if kinds else ""))


def progress_line(step: int, num_steps: int, metrics: dict[str, float],
                  seconds_left: float | None) -> str:
    """``step 3 (4/50 done) | loss 0.6931 | accuracy 0.500 | margin +0.012 | grad_norm 1.23
    | lr 1.00e-05 | 12.3 pairs/s | 1,234 tok/s | 1.3 s [| eval …] [| ETA …]``."""
    evaluated = f" | {eval_summary(metrics)}" if "eval/accuracy" in metrics else ""
    eta = f" | ETA {duration(seconds_left)}" if seconds_left else ""
    return (f"step {step} ({step + 1}/{num_steps} done) | loss {metrics['loss']:.4f} "
            f"| accuracy {metrics['accuracy']:.3f} | margin {metrics['margin']:+.3f} "
            f"| grad_norm {metrics['grad_norm']:.3g} | lr {metrics['lr']:.2e} "
            f"| {metrics['perf/pairs_per_s']:.1f} pairs/s "
            f"| {metrics['perf/tokens_per_s']:,.0f} tok/s "
            f"| {metrics['perf/step_time_s']:.1f} s{evaluated}{eta}")
