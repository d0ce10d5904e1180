"""The progress line (step numbers, KL, entropy, lr, ETA), the share of groups with a
learning signal, and the warning when no group has one for several steps."""

from __future__ import annotations

import pytest

from rollout.batch import RolloutBatch
from services.driver.metrics import (
    NO_SIGNAL_STEPS,
    LearningSignalWatch,
    Progress,
    groups_with_signal,
    progress_line,
    rollout_metrics,
)

ROW = {"reward/mean": 0.25, "pg_loss": -0.0123, "kl": 0.00042, "entropy": 1.234,
       "lr": 2e-3, "perf/tokens_per_s": 1234.0, "perf/step_time_s": 1.5,
       "padding_fraction": 0.1, "updates": 1.0, "reward/groups_with_signal": 0.5}


def batch(rewards: list[float], group_index: list[int]) -> RolloutBatch:
    return RolloutBatch.from_samples(
        prompt_ids=[[1, 2]] * len(rewards), response_ids=[[3, 4]] * len(rewards),
        response_log_probs=[[-1.0, -1.0]] * len(rewards), rewards=rewards,
        advantages=[0.0] * len(rewards), group_index=group_index, samples_per_prompt=2)


def test_groups_with_signal_counts_the_groups_whose_rewards_differ() -> None:
    # Groups 7 (1, 0: a signal), 8 (1, 1: none), 9 (0.5, 0.25: a signal).
    assert groups_with_signal(batch([1, 0, 1, 1, 0.5, 0.25], [7, 7, 8, 8, 9, 9])) == (
        pytest.approx(2 / 3))
    assert groups_with_signal(batch([0, 0, 0, 0], [3, 3, 4, 4])) == 0.0


def test_the_progress_line_names_the_step_as_the_rows_do_and_counts_the_steps_done() -> None:
    line = progress_line(3, 20, [ROW])
    assert line.startswith("step 3 (4/20 done) | reward 0.250 (last 10: 0.250) | "
                           "pg_loss -0.0123 | kl 0.0004 | entropy 1.234 | lr 2.00e-03 | "
                           "1,234 tok/s | 1.5 s | padding 10.0%"), line
    assert progress_line(0, 1, [{**ROW, "skipped": 1.0}]).startswith(
        "step 0 (1/1 done) | skipped")
    episodes = {"env/turns_mean": 2.5, "env/tool_calls_mean": 1.25, "env/seconds": 0.42,
                "env/failures": 0.0}
    assert progress_line(3, 20, [{**ROW, **episodes}]).endswith(
        "padding 10.0% | turns 2.5, tool calls 1.25, env 0.4 s")
    assert progress_line(3, 20, [{**ROW, **episodes, "env/failures": 2.0}]).endswith(
        ", env 0.4 s, 2 failed")
    del episodes["env/tool_calls_mean"]  # an environment that counts none
    assert progress_line(3, 20, [{**ROW, **episodes}]).endswith("| turns 2.5, env 0.4 s")


def test_the_eta_is_the_mean_step_time_so_far_times_the_steps_left() -> None:
    now = [100.0]
    progress = Progress(num_steps=10, clock=lambda: now[0])
    now[0] = 112.0  # the first step run here (step 4, after a resume) took 12 s
    assert progress.line(4, [ROW]).endswith(" | ETA 1m00s")  # 5 steps left × 12 s
    now[0] = 120.0  # 10 s per step on average
    assert progress.line(5, [ROW]).endswith(" | ETA 40 s")
    now[0] = 4000.0
    assert "ETA" not in progress.line(9, [ROW])  # the last step


def test_no_learning_signal_is_said_once_after_three_flat_steps_in_a_row() -> None:
    watch = LearningSignalWatch()
    flat = {"reward/mean": 0.0, "reward/groups_with_signal": 0.0}
    said = [watch.check(row) for row in (flat, flat, ROW, flat, flat)]
    assert said == [None] * 5  # a step with a signal starts the count again
    warning = watch.check(flat)
    assert warning == (f"no learning signal: every group has the same reward for "
                       f"{NO_SIGNAL_STEPS} steps (reward 0.000); check the reward function "
                       "and rollout.apply_chat_template")
    assert [watch.check(flat) for _ in range(5)] == [None] * 5  # once per job start


def test_the_steps_reward_metrics_leave_unscored_samples_out() -> None:
    from tests.rollout.test_unscored import REWARDS, UNSCORED, _batch

    batch = _batch()
    scored = [r for i, r in enumerate(REWARDS) if i not in UNSCORED]
    metrics = rollout_metrics(batch, [], {"train": 1.0}, 8.0)
    mean = sum(scored) / len(scored)
    std = (sum((r - mean) ** 2 for r in scored) / (len(scored) - 1)) ** 0.5
    assert metrics["reward/mean"] == pytest.approx(mean, rel=1e-6)
    assert metrics["reward/std"] == pytest.approx(std, rel=1e-6)
    # group 0 differs among its scored samples, group 1 differs, group 2 has none scored
    assert metrics["reward/groups_with_signal"] == pytest.approx(2 / 3)
