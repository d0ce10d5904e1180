"""A real job's per-token view (the session's clean run, tests/services/driver/
clean_run.py: the demo's tiny model on Ray, DP 2, 4 rollout steps, 8 samples logged
each): every logged training sample has its tokens, one per response token, their
advantage is the one the step trained with, and where the engine sampled with the
weights the step trains from (``rollout/staleness`` 0) the trainer's log-probs are the
engine's to fp32 precision, while one weight version later they are visibly not."""

from __future__ import annotations

import math

from services.driver.run_dir import SAMPLES_FILE
from services.driver.samples import read_samples
from services.driver.sinks import read_metrics
from tests.services.driver.clean_run import CleanRun

SAME_WEIGHTS_GAP = 1e-5
"""max |log π_trainer − log π_engine| over a step's tokens with the same weights: both in
fp32 on the CPU, the engine's KV-cached decode against the trainer's packed forward
(measured: ≤ 1e-6 on the clean run)."""

NO_TEXT = ("no tokens: the manager's records carry each token's text "
           "(rollout/rollouts/step.py training_records: tokens=response_tokens(sample, "
           "tokenizer), rollout/sample_tokens.py)")


def test_logged_samples_carry_their_tokens(clean_run: CleanRun) -> None:
    rows = read_samples(clean_run.path / SAMPLES_FILE, evaluation=False)
    staleness = {r["step"]: r["metrics"]["rollout/staleness"]
                 for r in read_metrics(clean_run.path / "metrics.jsonl")}
    assert staleness[0] == 0 and max(staleness.values()) > 0
    gaps: dict[int, list[float]] = {}
    for row in rows:
        assert "tokens" in row, NO_TEXT
        tokens = row["tokens"]
        count = row["response_tokens"]
        assert all(len(tokens[key]) == count for key in (
            "text", "observation", "advantage", "engine_log_prob", "trainer_log_prob",
            "entropy")), row["index"]
        assert "".join(tokens["text"]).startswith(row["response"][:8])
        assert not any(tokens["observation"])  # single-turn: every token the policy's
        # GRPO's advantage is the sample's on each token: the record's mean A_it
        assert all(math.isclose(a, row["advantage"], rel_tol=1e-6, abs_tol=1e-6)
                   for a in tokens["advantage"])
        assert all(0.0 < h <= math.log(100) for h in tokens["entropy"])  # 100 char ids
        gaps.setdefault(row["step"], []).extend(
            abs(t - e) for t, e in zip(tokens["trainer_log_prob"], tokens["engine_log_prob"],
                                       strict=True))
    assert sorted(gaps) == [0, 1, 2, 3]
    for step, step_gaps in gaps.items():
        if staleness[step] == 0:
            assert max(step_gaps) < SAME_WEIGHTS_GAP, (step, max(step_gaps))
        else:  # trained since the engine sampled: the view shows it
            assert max(step_gaps) > 10 * SAME_WEIGHTS_GAP, (step, max(step_gaps))
