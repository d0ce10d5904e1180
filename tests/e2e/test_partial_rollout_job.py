"""A job with partial rollouts (rollout.partial_rollout) stopped and resumed trains bit for
bit what an uninterrupted one does, although its checkpoints hold samples paused in the
middle of their responses; its rows carry the per-token staleness metrics (its own file:
two jobs, which the test workers can run beside the others)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.slow  # two jobs
def test_a_partial_rollout_job_resumes_exactly_with_samples_in_flight(
        ray_cluster: None, tmp_path: Path) -> None:
    """The clean job with partial rollouts on one trainer rank, one rollout asked for
    ahead and a pause every 2 tokens: stopped after step 1 and resumed, it trains bit for bit what
    the uninterrupted run does; some step trains samples whose tokens span two weight
    versions, none older than rollout.max_staleness."""
    from tests.services.driver.clean_run import assert_resumes_exactly, clean_config, rows

    config = clean_config("rollout.async_steps=1", "rollout.partial_rollout=true",
                          "rollout.partial_chunk_tokens=2", "num_steps=3",
                          "trainer.dp_size=1")
    whole = assert_resumes_exactly(config, tmp_path)
    metrics = [r["metrics"] for r in rows(whole / "metrics.jsonl")]
    assert max(m["rollout/partial_fraction"] for m in metrics) > 0
    bound = config.rollout.staleness_bound
    assert all(0 <= m["rollout/staleness_mean"] <= m["rollout/staleness_max"] <= bound
               for m in metrics)
    assert all(m["rollout/stale_dropped"] >= 0 for m in metrics)
