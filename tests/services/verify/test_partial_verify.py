"""`tally verify-aggregation` on a job with partial rollouts (services/verify/partial.py):
the batch's samples span two and three weight versions, each token's behaviour log-prob is
its own version's, and every layout agrees with the reference in every mode; the planted
``one_version_per_sample`` (the pool tags a sample with one version) exits 1."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PARTIAL = ["rollout.async_steps=1", "rollout.partial_rollout=true"]


def _verified(layouts: str, planted: dict) -> tuple[int, list[str]]:
    from services.config.job import load_job_config
    from services.verify.aggregation import parse_layouts, verify_aggregation

    lines: list[str] = []
    code = verify_aggregation(load_job_config(ROOT / "configs" / "demo.yaml", PARTIAL),
                              parse_layouts(layouts), planted=planted, echo=lines.append)
    print("\n".join(lines))  # the figures, for -s
    return code, lines


def _row(lines: list[str], term: str) -> str:
    (line,) = [line for line in lines if line.startswith("engine") and f" {term} " in line]
    return line


@pytest.mark.slow  # the demo's warm start, a 4-step draw and three layouts on Ray actors
def test_partial_rollout_batch_verifies_over_padded_packed_and_cp_layouts(
        ray_cluster: None, shared_data_dir: Path) -> None:
    """The done-when command's job (`--set rollout.async_steps=1 --set
    rollout.partial_rollout=true`, the CLI's default layouts) exits 0: a spans row (two-
    and three-version samples both present), a behaviour row, and the layouts' rows for
    every mode."""
    code, lines = _verified("dp1cp1-padded,dp2cp1-prefix,dp1cp2", {})
    assert code == 0
    assert _row(lines, "spans").endswith("ok") and _row(lines, "behav").endswith("ok")
    modes = {line.split()[1] for line in lines if line.startswith(("dp2cp1", "dp1cp2"))}
    assert {"sample_mean", "token_mean", "prompt_mean", "constant"} <= modes


@pytest.mark.slow  # the demo's warm start and a 4-step draw
def test_one_version_per_sample_planted_in_the_pool_exits_1(
        ray_cluster: None, shared_data_dir: Path) -> None:
    """The pool tags each continued sample with its first token's version: no sample spans
    versions any more and the tokens' log-probs are not their tags' weights: both rows
    fail and the program exits 1 (one layout: nothing else to compare)."""
    code, lines = _verified("dp1cp1", {"rollout": frozenset({"one_version_per_sample"})})
    assert code == 1
    assert _row(lines, "spans").endswith("FAIL") and _row(lines, "behav").endswith("FAIL")
