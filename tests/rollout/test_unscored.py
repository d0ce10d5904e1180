"""An unscored sample is missing, not zero (issue 52): a reward part's None travels from
the part (a judge's unparsed answer or failed call) through the Rewarder and
``build_batch`` (what the manager calls) to the estimators' ``apply`` (what the manager
and driver call). Held to the formulas written out here in float64: GRPO / Dr. GRPO of a
group with an unscored member equal GRPO over the scored members only and the unscored
one gets 0; REINFORCE++ likewise over the batch; GAE gives it A = 0, R = V and leaves it
out of the whitening. A planted error (unscored counted as a zero reward) fails."""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
from pathlib import Path

import pytest
import torch

from rollout.advantages import build_estimator
from rollout.advantages.base import AdvantageEstimator
from rollout.advantages.gae import with_gae
from rollout.advantages.grpo import grpo_advantages
from rollout.batch import RolloutBatch, RolloutBatchError
from rollout.config import AdvantageConfig
from rollout.datasets import PromptRecord
from rollout.engines.base import Generation
from rollout.remote import CallTally
from rollout.reward_config import JudgeConfig
from rollout.reward_parts.judge import JudgePart
from rollout.reward_parts.rewarder import Rewarder
from rollout.rollouts.base import Sample
from rollout.rollouts.step import build_batch, groups_of, training_records
from rollout.sample_record import SampleRecord
from services.config.job import JobConfig

G = 4
NAN = float("nan")
# two parts: a rule always scores; the judge's None leaves a sample unscored
REWARDS = [1.0, 0.0, 0.5, 0.25,   # group 0: sample 2 unscored
           1.0, 1.0, 0.0, 0.0,    # group 1: all scored
           0.3, 0.7, 0.9, 0.1]    # group 2: all unscored
UNSCORED = {2, 8, 9, 10, 11}


def _samples(seed: int = 0) -> list[Sample]:
    """Samples as a single-turn rollout plays them: parts {rule, judge}, the judge's None
    on the unscored ones (their total a placeholder: the rule's part alone)."""
    rng = random.Random(seed)
    out = []
    for i, reward in enumerate(REWARDS):
        response = [rng.randint(3, 30) for _ in range(rng.randint(1, 6))]
        judge = None if i in UNSCORED else reward - 0.25
        out.append(Sample(PromptRecord(f"p{i // G}", label="x"), [1] * rng.randint(1, 3),
                          Generation(response, [-0.5] * len(response), "stop"),
                          reward if judge is not None else 0.25, f"text {i}",
                          {"rule": 0.25, "judge": judge}))
    return out


def _batch(seed: int = 0) -> RolloutBatch:
    return build_batch(groups_of(_samples(seed), G), 0, G, 0, {}, [], [])


def grpo_reference(rewards: list[float], unscored: set[int], normalize_std: bool,
                   eps: float) -> list[float]:
    """GRPO over each group's scored members, in plain float64; 0 for an unscored one."""
    out = [0.0] * len(rewards)
    for start in range(0, len(rewards), G):
        members = [i for i in range(start, start + G) if i not in unscored]
        if not members:
            continue
        mean = sum(rewards[i] for i in members) / len(members)
        std = (math.sqrt(sum((rewards[i] - mean) ** 2 for i in members) / (len(members) - 1))
               if len(members) > 1 else 0.0)
        for i in members:
            out[i] = (rewards[i] - mean) / (std + eps) if normalize_std else rewards[i] - mean
    return out


def reinforce_pp_reference(rewards: list[float], unscored: set[int], eps: float
                           ) -> list[float]:
    """a_i = r_i − μ_g (scored members), whitened over the batch's scored samples."""
    centred = grpo_reference(rewards, unscored, False, eps)
    kept = [centred[i] for i in range(len(rewards)) if i not in unscored]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((a - mean) ** 2 for a in kept) / (len(kept) - 1))
    return [0.0 if i in unscored else (centred[i] - mean) / (std + eps)
            for i in range(len(rewards))]


def _per_sample(batch: RolloutBatch) -> list[float]:
    """Each sample's advantage (equal over its tokens; 0 for a sample without any)."""
    rows = []
    for i in range(batch.num_samples):
        valid = batch.advantages[i][batch.loss_mask[i] > 0]
        assert torch.equal(valid, valid[:1].expand_as(valid)) if len(valid) else True
        rows.append(float(valid[0]) if len(valid) else 0.0)
    return rows


def test_build_batch_marks_unscored_samples_and_keeps_them_out_of_the_metrics() -> None:
    batch = _batch()
    assert batch.scored.tolist() == [i not in UNSCORED for i in range(len(REWARDS))]
    assert all(float(batch.rewards[i]) == 0.0 for i in UNSCORED)  # a fill value only
    scored = [r for i, r in enumerate(REWARDS) if i not in UNSCORED]
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / (len(scored) - 1))
    assert batch.metadata["rollout/reward_mean"] == pytest.approx(mean, abs=1e-6)
    assert batch.metadata["rollout/reward_std"] == pytest.approx(std, abs=1e-6)
    assert batch.metadata["rollout/unscored_samples"] == len(UNSCORED)
    judge = [r - 0.25 for i, r in enumerate(REWARDS) if i not in UNSCORED]
    assert batch.metadata["reward/judge/mean"] == pytest.approx(sum(judge) / len(judge))
    assert batch.metadata["reward/rule/mean"] == pytest.approx(0.25)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_of_a_group_with_an_unscored_member_is_grpo_over_the_scored_ones(
        normalize_std: bool) -> None:
    estimator = build_estimator(AdvantageConfig(type="grpo", normalize_std=normalize_std))
    got = _per_sample(estimator.apply(_batch()))
    expected = grpo_reference(REWARDS, UNSCORED, normalize_std, 1e-6)
    assert got == pytest.approx(expected, abs=1e-6)
    assert all(got[i] == 0.0 for i in UNSCORED)  # the all-unscored group too
    # the same as GRPO of group 0 with the unscored sample left out entirely
    alone = grpo_advantages(torch.tensor([1.0, 0.0, 0.25]), torch.zeros(3, dtype=torch.int64),
                            normalize_std)
    assert [got[0], got[1], got[3]] == pytest.approx(alone.tolist(), abs=1e-6)


def test_the_planted_error_unscored_as_zero_fails() -> None:
    """Counting the unscored sample as a zero reward (today's behaviour) moves group 0's
    baseline: the formula check catches it."""
    batch = _batch()
    planted = grpo_advantages(batch.rewards, batch.group_index)  # scored ignored
    expected = grpo_reference(REWARDS, UNSCORED, True, 1e-6)
    with pytest.raises(AssertionError):
        assert planted.tolist() == pytest.approx(expected, abs=1e-6)


def test_the_unscored_placeholder_value_never_matters() -> None:
    """Whatever an unscored sample's reward slot holds, the scored ones' advantages are
    the same (group_stats leaves it out, not just multiplies it by 0: a NaN stays out)."""
    batch = _batch()
    rewards = batch.rewards.clone()
    for i in UNSCORED:
        rewards[i] = [123.0, -7.0, NAN][i % 3]
    base = grpo_advantages(batch.rewards, batch.group_index, scored=batch.scored)
    moved = grpo_advantages(rewards, batch.group_index, scored=batch.scored)
    assert torch.equal(base, moved)


def test_reinforce_pp_leaves_unscored_samples_out_of_the_batch_whitening() -> None:
    got = _per_sample(build_estimator(AdvantageConfig(type="reinforce_pp")).apply(_batch()))
    assert got == pytest.approx(reinforce_pp_reference(REWARDS, UNSCORED, 1e-6), abs=1e-5)


def test_a_users_estimator_gets_zero_for_unscored_samples() -> None:
    """apply() zeroes an unscored row whatever the estimator returned; one that does not
    use rewards (a teacher's term) keeps its own."""

    class Ones(AdvantageEstimator):
        def __call__(self, inputs):  # type: ignore[no-untyped-def]
            return torch.ones_like(inputs.loss_mask)

    class Teacher(Ones):
        uses_rewards = False

    batch = _batch()
    assert _per_sample(Ones().apply(batch)) == [0.0 if i in UNSCORED else 1.0
                                                for i in range(len(REWARDS))]
    assert _per_sample(Teacher().apply(batch)) == [1.0] * len(REWARDS)
    got = _per_sample(build_estimator(AdvantageConfig(type="reward")).apply(batch))
    assert got == pytest.approx([0.0 if i in UNSCORED else r for i, r in enumerate(REWARDS)])


def _gae_reference(batch: RolloutBatch, values: torch.Tensor, lam: float, eps: float
                   ) -> tuple[list[list[float]], list[list[float]]]:
    """(A whitened over the scored samples' tokens, R) by loops, γ = 1, λ for A,
    critic λ = 1 for R; an unscored sample: A = 0, R = V."""
    raw, returns = [], []
    for i in range(batch.num_samples):
        positions = [t for t in range(batch.loss_mask.shape[1]) if batch.loss_mask[i, t] > 0]
        v = [float(values[i, t]) for t in positions]
        r = [0.0] * len(v)
        r[-1] = float(batch.rewards[i])
        a_row, ret_row, running, running_r = [0.0] * len(v), [0.0] * len(v), 0.0, 0.0
        for k in range(len(v) - 1, -1, -1):
            delta = r[k] + (v[k + 1] if k + 1 < len(v) else 0.0) - v[k]
            running = delta + lam * running
            running_r = delta + running_r
            a_row[k], ret_row[k] = running, running_r + v[k]
        raw.append(a_row)
        returns.append(v if not batch.scored[i] else ret_row)
    kept = [a for i, row in enumerate(raw) if batch.scored[i] for a in row]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((a - mean) ** 2 for a in kept) / (len(kept) - 1))
    advantages = [[(a - mean) / (std + eps) if batch.scored[i] else 0.0 for a in row]
                  for i, row in enumerate(raw)]
    return advantages, returns


def test_gae_gives_unscored_samples_zero_and_their_own_values_as_targets() -> None:
    batch = _batch(1)
    values = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(3))
    config = AdvantageConfig(type="gae", gamma=1.0, lam=0.9, critic_lam=1.0, normalize=True)
    out = with_gae(batch, values, config)
    expected_a, expected_r = _gae_reference(batch, values, 0.9, config.eps)
    for i in range(batch.num_samples):
        valid = batch.loss_mask[i] > 0
        assert out.advantages[i][valid].tolist() == pytest.approx(expected_a[i], abs=1e-5)
        assert out.returns[i][valid].tolist() == pytest.approx(expected_r[i], abs=1e-5)


def test_batch_accepts_unscored_samples_and_keeps_its_checks() -> None:
    batch = _batch()
    assert torch.equal(batch.select(list(range(G))).scored, batch.scored[:G])
    with pytest.raises(RolloutBatchError, match="rewards: an unscored"):
        RolloutBatch.from_samples([[1]] * G, [[2]] * G, [[-0.1]] * G, [1.0, 0, 0, 0],
                                  [0.0] * G, [0] * G, G, scored=[False, True, True, True])
    with pytest.raises(RolloutBatchError, match="rewards: contains NaN"):
        RolloutBatch.from_samples([[1]] * G, [[2]] * G, [[-0.1]] * G, [0, NAN, 0, 0],
                                  [0.0] * G, [0] * G, G, scored=[False, True, True, True])
    assert RolloutBatch.from_samples([[1]] * G, [[2]] * G, [[-0.1]] * G, [0.0] * G,
                                     [0.0] * G, [0] * G, G).scored.all()


def test_a_judge_part_leaves_unparsed_and_failed_answers_unscored() -> None:
    part = JudgePart(JudgeConfig(url="http://127.0.0.1:9"))
    answers = ["I give it a 7.", "hmm", None, "Score: 11", "8/10"]
    scores = part.collect([((lambda: (answers[:2], 0.0, 0)), CallTally()),
                           ((lambda: (answers[2:], 0.0, 0)), CallTally())])
    assert scores.values == [0.7, None, None, None, 0.8]
    assert scores.counts == {"unparsed": 2, "unscored": 3, "over_budget": 0,
                             "failed_calls": 0, "retries": 0}
    assert scores.answers == answers


def test_the_rewarder_marks_a_sample_unscored_when_any_part_is() -> None:
    configs = JobConfig.model_validate({"rollout": {"reward": [
        {"type": "exact_match", "weight": 2.0},
        {"type": "custom", "name": "mine", "weight": -1.0,
         "class_path": "tests.rollout.reward_classes:ExactMatch"},
    ]}}).rollout.reward_parts
    rewarder = Rewarder(configs, {})
    responses, labels = ["a", "b", "c"], ["a", "x", None]
    scores = rewarder.score(responses, responses, responses, labels, [{}] * 3,
                            update_stats=False)
    assert scores.parts["mine"] == [1.0, 0.0, None]
    assert scores.scored == [True, True, False]
    assert scores.total[:2] == [2.0 - 1.0, 0.0]
    assert scores.counts["reward/mine/unscored"] == 1


def test_samples_jsonl_keeps_the_judge_answer_and_a_missing_reward() -> None:
    record = SampleRecord(step=3, group=1, prompt="p", record_prompt="p", response="r",
                          label=None, reward=None, rewards={"judge": None},
                          index=0, judge_answers={"judge": "hmm, hard to say"})
    row = record.to_json()
    assert row["reward"] is None and row["rewards"] == {"judge": None}
    assert row["judge_answers"] == {"judge": "hmm, hard to say"}
    assert SampleRecord.from_json(row) == record
    plain = SampleRecord(step=3, group=1, prompt="p", record_prompt="p", response="r",
                         label=None, reward=1.0, index=0).to_json()
    assert "judge_answers" not in plain  # lines without a judge are unchanged


def test_training_records_write_null_for_an_unscored_reward() -> None:
    class Decode:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "p"

    groups = groups_of(_samples(), G)
    records = training_records(groups, 0, 1, 12, Decode())  # type: ignore[arg-type]
    assert [r.reward is None for r in records] == [i in UNSCORED for i in range(12)]
    assert records[2].rewards == {"rule": 0.25, "judge": None}


def test_the_flags_travel_through_pickle_and_the_driver_checkpoint(tmp_path: Path) -> None:
    from services.driver.checkpoint import DriverState, load_driver_state, save_driver_state

    batch = _batch()
    for loaded in (pickle.loads(pickle.dumps(batch)),
                   pickle.loads(pickle.dumps(batch, protocol=5))):
        assert torch.equal(loaded.scored, batch.scored)
    save_driver_state(tmp_path, DriverState(3, {}, {4: batch}))
    restored = load_driver_state(tmp_path).in_flight[4]
    assert torch.equal(restored.scored, batch.scored)  # type: ignore[arg-type]
    old = dataclasses.replace(batch, scored=None, rewards=torch.ones(len(REWARDS)))
    assert old.scored is not None and old.scored.all()  # a checkpoint before the field


def test_dynamic_sampling_reads_the_spread_of_a_groups_scored_samples_only() -> None:
    from rollout.dynamic_sampling import split_by_spread

    groups = groups_of(_samples(), G)
    rewards = [[s.reward for s in g.samples if s.scored] for g in groups]
    # group 0: scored 1.0, 0.0, 0.25 (spread); group 1: 1, 1, 0, 0; group 2: none scored
    assert split_by_spread(rewards) == ([0, 1], [2])
    assert split_by_spread([[0.5, 0.5], [0.7]]) == ([], [0, 1])  # one scored: no spread
