"""How often two reward parts agree on the same samples: a judge or a reward model against
a rule, read from a job's samples.jsonl (every part's value of every logged sample).

A part's verdict is "good" when its value reaches its threshold (default 0.5: a rule's
1/0, a yes-no or 0-10 judge). Prints, for training and evaluation samples apart: the
samples, each part's good fraction, the agreement (both good or both not), Cohen's κ,
and the confusion counts. For a reward model (a score, no threshold) the table gives the
mean score of the samples the rule calls good and of those it calls bad, and the AUC
(the chance a good sample outscores a bad one).

    .venv/bin/python benchmarks/reward_agreement.py JOB_FOLDER --parts correct judge
        [--thresholds 0.5 0.5] [--steps 0-11]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.driver.samples import read_samples


def agreement(a: list[bool], b: list[bool]) -> tuple[float, float]:
    """(observed agreement, Cohen's κ)."""
    n = len(a)
    observed = sum(x == y for x, y in zip(a, b, strict=True)) / n
    pa, pb = sum(a) / n, sum(b) / n
    chance = pa * pb + (1 - pa) * (1 - pb)
    kappa = (observed - chance) / (1 - chance) if chance < 1 else float("nan")
    return observed, kappa


def auc(good: list[float], bad: list[float]) -> float:
    """P(a good sample's score > a bad one's), ties counted half."""
    if not good or not bad:
        return float("nan")
    wins = sum((g > b) + 0.5 * (g == b) for g in good for b in bad)
    return wins / (len(good) * len(bad))


def report(rows: list[dict], rule: str, other: str, thresholds: tuple[float, float],
           what: str) -> None:
    rows = [r for r in rows if rule in r.get("rewards", {}) and other in r["rewards"]]
    if not rows:
        print(f"{what}: no samples with both {rule} and {other}")
        return
    ruled = [r["rewards"][rule] >= thresholds[0] for r in rows]
    scores = [r["rewards"][other] for r in rows]
    judged = [s >= thresholds[1] for s in scores]
    observed, kappa = agreement(ruled, judged)
    good = [s for s, ok in zip(scores, ruled, strict=True) if ok]
    bad = [s for s, ok in zip(scores, ruled, strict=True) if not ok]
    both = sum(x and y for x, y in zip(ruled, judged, strict=True))
    neither = sum(not x and not y for x, y in zip(ruled, judged, strict=True))
    print(f"{what}: {len(rows)} samples | {rule} good {sum(ruled) / len(rows):.3f} | "
          f"{other} good {sum(judged) / len(rows):.3f} | agreement {observed:.3f} "
          f"(kappa {kappa:+.3f}) | both good {both}, both bad {neither}, "
          f"only {rule} {sum(ruled) - both}, only {other} {sum(judged) - both}")
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    print(f"{'':{len(what)}}  {other} mean where {rule} good {mean(good):+.4f}, where bad "
          f"{mean(bad):+.4f}; AUC {auc(good, bad):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", type=Path)
    parser.add_argument("--parts", nargs=2, default=["correct", "judge"],
                        metavar=("RULE", "OTHER"))
    parser.add_argument("--thresholds", nargs=2, type=float, default=[0.5, 0.5])
    parser.add_argument("--steps", default=None, help="first-last rollout steps, e.g. 0-5")
    args = parser.parse_args()
    rows = read_samples(args.job / "samples.jsonl")
    if args.steps:
        first, _, last = args.steps.partition("-")
        rows = [r for r in rows if int(first) <= r["step"] <= int(last or first)]
    rule, other = args.parts
    thresholds = (args.thresholds[0], args.thresholds[1])
    report([r for r in rows if not r.get("eval")], rule, other, thresholds, "training")
    report([r for r in rows if r.get("eval")], rule, other, thresholds, "held-out")


if __name__ == "__main__":
    main()
