"""PPO with a learned critic end to end on real Ray (configs/demo-ppo.yaml): the critic's
ranks in the job's gang, values then GAE, the policy and the critic stepping on the same
mini-batches; a resume (DP 2, async 1, 2 PPO epochs, a checkpoint every step, the
critic's warm-up crossed) trains bit for bit what the whole run does, critic included;
and the demo learns the copy task while the critic's explained variance rises above 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from services.config.job import load_job_config
from services.driver.loop import run_job
from tests.services.driver.clean_run import CLEAN, ROOT, assert_resumes_exactly, rows
from trainer.checkpoint import CRITIC_DIR

PPO = ROOT / "configs" / "demo-ppo.yaml"


@pytest.mark.slow  # three runs of 4 rollout steps with a critic group beside the policy
def test_a_resumed_ppo_job_with_a_critic_trains_what_the_whole_run_does(
        ray_cluster: None, tmp_path: Path) -> None:
    config = load_job_config(PPO, [*CLEAN, "rollout.async_steps=1",
                                   "critic.warmup_steps=1", "critic.dp_size=2",
                                   "trainer.num_cpus_per_rank=0.5"])  # 4 CPUs: all ranks
    whole = assert_resumes_exactly(config, tmp_path, stop_at=1)
    history = [row["metrics"] for row in rows(whole / "metrics.jsonl")]
    assert "pg_loss" not in history[0] and "pg_loss" in history[1]  # the warm-up step
    assert all(row["critic/value_loss"] > 0 and "critic/grad_norm" in row
               for row in history)
    checkpoint = whole / "checkpoints" / "step_00000003"
    assert (checkpoint / CRITIC_DIR / "shards" / ".metadata").is_file()
    # The policy moved and so did the critic's head (its own optimizer, its own shards).
    final = load_file(str(whole / "final_model" / "model.safetensors"))
    assert "score.weight" not in final  # the export is the policy's


@pytest.mark.slow  # the demo's warm start (cached), then 40 rollout steps
def test_demo_ppo_learns_copy_and_its_critic_explains_the_returns(
        ray_cluster: None, tmp_path: Path) -> None:
    config = load_job_config(PPO, ["num_steps=40", "trainer.optimizer.schedule=constant",
                                   "trainer.dp_size=1"])
    history = run_job(config, tmp_path / "job", log=lambda *_: None)
    rewards = [row["reward/mean"] for row in history]
    assert sum(rewards[-8:]) / 8 > sum(rewards[:5]) / 5 + 0.1, rewards
    explained = [row["critic/explained_variance"] for row in history]
    assert explained[0] < 0.1 and sum(explained[-8:]) / 8 > 0.15, explained
    assert all("critic/clip_fraction" in row for row in history)
