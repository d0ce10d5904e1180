"""PPO with a learned critic end to end on real Ray (configs/demo-ppo.yaml): the critic's
ranks in the job's gang, values then GAE, the policy and the critic stepping on the same
mini-batches; a resume (DP 2, async 1, 2 PPO epochs, a checkpoint every step, the
critic's warm-up crossed) trains bit for bit what the whole run does, critic included,
with the KL in the reward under an adaptive β (Ziegler's rule in every row, β resumed
exactly); and the demo learns the copy task while the critic's explained variance rises
above 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from services.config.job import load_job_config
from services.driver.advantages import KL_CONTROLLER_STATE
from services.driver.loop import run_job
from tests.services.driver.clean_run import CLEAN, ROOT, assert_resumes_exactly, rows
from trainer.checkpoint import CRITIC_DIR

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Jobs in this process: each may take the gang the last one left (tests/conftest.py)."""

PPO = ROOT / "configs" / "demo-ppo.yaml"
KL_TARGET, KL_HORIZON = 0.002, 32
KL_IN_REWARD = ["trainer.loss.kl_coef=0.05", "trainer.loss.kl_placement=reward",
                "trainer.loss.kl_controller.type=adaptive",
                f"trainer.loss.kl_controller.target={KL_TARGET}",
                f"trainer.loss.kl_controller.horizon={KL_HORIZON}"]
"""−β·k1 in the token rewards, β from 0.05 moved by up to 20 % a step (32 samples)."""


def assert_beta_follows_ziegler(history: list[dict], num_samples: int) -> None:
    """Each row's β is the last one moved by Ziegler's rule with that row's mean KL per
    sample, written out here: toward the target, up when the KL was above it."""
    beta = 0.05
    for row in history:
        assert row["kl/beta"] == pytest.approx(beta, rel=1e-12), (row["kl/beta"], beta)
        error = max(-0.2, min(0.2, row["kl/mean"] / KL_TARGET - 1))
        beta *= 1 + error * num_samples / KL_HORIZON
        assert (beta > row["kl/beta"]) == (row["kl/mean"] > KL_TARGET)
    assert beta != 0.05


@pytest.mark.slow  # three runs of 4 rollout steps with a critic group beside the policy
def test_a_resumed_ppo_job_with_a_critic_trains_what_the_whole_run_does(
        ray_cluster: None, tmp_path: Path) -> None:
    config = load_job_config(PPO, [*CLEAN, "rollout.async_steps=1",
                                   "critic.warmup_steps=1", "critic.dp_size=2",
                                   "trainer.num_cpus_per_rank=0.5",  # 4 CPUs: all ranks
                                   *KL_IN_REWARD])
    whole = assert_resumes_exactly(config, tmp_path, stop_at=1)  # β resumed: rows equal
    history = [row["metrics"] for row in rows(whole / "metrics.jsonl")]
    assert_beta_follows_ziegler(history, num_samples=32)
    # Until the policy's first step (after the critic's warm-up) π_old is the reference:
    # the reference's log-probs (its own verb) agree with the policy's to the bit.
    assert [row["kl/mean"] for row in history[:2]] == [0.0, 0.0]
    assert history[2]["kl/mean"] != 0.0  # and the policy has moved from it since
    assert all("critic/explained_variance" in row for row in history)
    assert "pg_loss" not in history[0] and "pg_loss" in history[1]  # the warm-up step
    assert all(row["critic/value_loss"] > 0 and "critic/grad_norm" in row
               for row in history)
    checkpoint = whole / "checkpoints" / "step_00000003"
    assert (checkpoint / CRITIC_DIR / "shards" / ".metadata").is_file()
    assert (checkpoint / KL_CONTROLLER_STATE).is_file()
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
