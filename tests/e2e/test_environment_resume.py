"""A multi-turn environment job stopped and resumed trains bit for bit what an
uninterrupted one does, with holes in every sample's loss mask (its own file: two jobs,
which the test workers can run beside test_environment_job.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Jobs in this process: each may take the gang the last one left (tests/conftest.py)."""

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two jobs
def test_an_environment_job_resumes_exactly_with_async_packing_and_several_updates(
        ray_cluster: None, tmp_path: Path) -> None:
    """The clean job's layout (3 rollout steps here; DP 2, packed rows sharing each
    group's first observation, two rollouts asked for ahead and kept in checkpoints, 4
    optimizer steps per rollout) with the guessing game: stopped after step 1 and resumed,
    it trains bit for bit what the uninterrupted run does, on samples with holes in their
    loss mask."""
    from tests.services.driver.clean_run import assert_resumes_exactly, clean_config, rows

    game = json.dumps({"type": "jsonl", "path": str(ROOT / "configs" / "data" /
                                                     "guess-number.jsonl")})
    config = clean_config(
        "warmup.enabled=false", f"rollout.dataset={game}", "rollout.sampling.max_new_tokens=6",
        "rollout.environment.class_path=rollout.environments.guess_number:GuessNumber",
        "rollout.environment.max_total_tokens=64", "rollout.environment.max_turns=4",
        "rollout.max_prompt_tokens=150", "rollout.prompt_truncation=truncate_left",
        "trainer.loss.entropy_coef=0.01", "num_steps=3")
    whole = assert_resumes_exactly(config, tmp_path)
    metrics = [r["metrics"] for r in rows(whole / "metrics.jsonl")]
    assert all(m["env/policy_token_share"] < 1 and m["env/observations_mean"] > 0
               for m in metrics)
    assert all(m["updates"] == 4 for m in metrics)
