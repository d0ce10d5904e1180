"""A job with partial rollouts (rollout.partial_rollout) stopped and resumed trains bit for
bit what an uninterrupted one does, from a checkpoint that holds samples paused in the
middle of their responses; its rows carry the per-token staleness metrics (its own file:
two jobs, which the test workers can run beside the others)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Jobs in this process: each may take the gang the last one left (tests/conftest.py)."""


@pytest.mark.slow  # two jobs
def test_a_partial_rollout_job_resumes_exactly_with_samples_in_flight(
        ray_cluster: None, tmp_path: Path) -> None:
    """The clean job with partial rollouts on one trainer rank, one rollout asked for
    ahead and a pause every 2 tokens, stopped after step 1 and resumed: step 2 is the
    rollout kept in flight, step 3 is generated after the resume from the manager's pool
    as the checkpoint held it (samples paused mid-response). It trains bit for bit what
    the uninterrupted run does; some step trains samples whose tokens span two weight
    versions, none older than rollout.max_staleness, and none was dropped."""
    from tests.services.driver.clean_run import assert_resumes_exactly, clean_config, rows

    config = clean_config("rollout.async_steps=1", "rollout.partial_rollout=true",
                          "rollout.partial_chunk_tokens=2", "num_steps=4",
                          "trainer.dp_size=1")
    whole = assert_resumes_exactly(config, tmp_path)
    state = json.loads((whole / "checkpoints" / "step_00000001" / "driver_state.json").read_text())
    paused = [s for g in state["rollout"]["partial"]["groups"] for s in g["samples"]
              if s["tokens"] and s["finish"] is None]
    assert paused  # the resumed run's pool held samples mid-response
    metrics = [r["metrics"] for r in rows(whole / "metrics.jsonl")]
    assert max(m["rollout/partial_fraction"] for m in metrics) > 0
    bound = config.rollout.staleness_bound
    assert all(0 <= m["rollout/staleness_mean"] <= m["rollout/staleness_max"] <= bound
               for m in metrics)
    assert sum(m["rollout/stale_dropped"] for m in metrics) == 0  # the default bound
