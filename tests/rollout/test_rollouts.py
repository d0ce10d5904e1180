"""The one rollout interface (rollout/rollouts/): a training step and an evaluation both
play through the manager's one Rollout, single-turn and an environment's episodes alike,
and what the manager hands on is what was played."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rollout.config import RolloutConfig
from rollout.manager import RolloutManager
from rollout.rollouts import Episodic, Play, Played, Rollout, SingleTurn, StepStats
from rollout.sample_record import SampleRecord
from services.runtime.gang import start_rollout_actors

BASE = {"dataset": {"type": "synthetic", "task": "copy", "num_prompts": 6, "seed": 1},
        "engine": {"type": "torch", "num_engines": 1}, "sampling": {"max_new_tokens": 4},
        "n_samples_per_prompt": 2, "global_batch_size": 4, "seed": 3,
        "apply_chat_template": False}
CONFIGS = {
    "single_turn": (RolloutConfig.model_validate(BASE), SingleTurn),
    "episodes": (RolloutConfig.model_validate({
        **BASE, "environment": {"class_path": "tests.rollout.toy_envs:Countdown",
                                "max_turns": 2, "max_total_tokens": 48}}), Episodic),
}


class Recording(Rollout):
    """The manager's own rollout, each call to it written down (it plays every one)."""

    def __init__(self, inner: Rollout) -> None:
        self.inner, self.writes_prompts = inner, inner.writes_prompts
        self.calls: list[tuple[list[Play], bool, Played]] = []

    def play(self, plays: list[Play], training: bool) -> Played:
        played = self.inner.play(plays, training)
        self.calls.append((plays, training, played))
        return played

    def finish(self, stats: StepStats, step: int
               ) -> tuple[dict[str, float], list[tuple[str, str]]]:
        return self.inner.finish(stats, step)


@pytest.fixture(params=list(CONFIGS))
def manager(request: pytest.FixtureRequest, ray_cluster: None, tiny_model_path: str
            ) -> Iterator[tuple[RolloutManager, type]]:
    config, kind = CONFIGS[request.param]
    actors = start_rollout_actors(config, tiny_model_path)
    manager = RolloutManager(config, tiny_model_path, engines=actors.engines,
                             owns_engines=True, teachers=actors.teachers,
                             reward_actors=actors.reward_actors)
    yield manager, kind
    manager.shutdown()


@pytest.mark.slow  # an engine actor and a manager per kind
def test_training_and_evaluation_play_through_the_one_rollout(
        manager: tuple[RolloutManager, type]) -> None:
    manager_, kind = manager
    assert type(manager_.rollout) is kind
    recording = Recording(manager_.rollout)
    manager_.rollout = recording  # type: ignore[misc]  # cached: the one every call uses

    batch = manager_.generate_batch(0)
    (plays, training, played), = recording.calls
    assert training and [(p.key, p.draw, len(p.requests)) for p in plays] == [(0, 0, 4)]
    numbers = [r.number for r in plays[0].requests]
    assert numbers[0::2] == numbers[1::2] and len(set(numbers)) == 2  # each record G times
    assert batch.rewards.tolist() == [s.reward for s in played.samples]
    assert batch.response_lengths.tolist() == [len(s.generation.token_ids)
                                               for s in played.samples]
    assert [r.response for r in batch.samples] == [s.text for s in played.samples]

    dataset = manager_.config.dataset.model_copy(update={"seed": 9})
    run = manager_.evaluate(dataset, 3, 2, 1.0, 5)
    plays, training, played = recording.calls[1]
    assert not training
    assert [(p.key, p.draw, len(p.requests)) for p in plays] == [
        ("eval:5:greedy", 0, 3), ("eval:5:sampled", 0, 6)]
    assert [p.sampling.temperature for p in plays] == [0.0, 1.0]
    greedy, sampled = played.samples[:3], played.samples[3:]
    assert [o.greedy_reward for o in run.outcomes] == [s.reward for s in greedy]
    assert [o.sample_rewards for o in run.outcomes] == [[s.reward for s in sampled[j:j + 2]]
                                                        for j in (0, 2, 4)]
    for j, outcome in enumerate(run.outcomes):  # an environment's samples too, now
        assert all(isinstance(r, SampleRecord) for r in outcome.samples)
        assert [(r.greedy, r.group, r.step) for r in outcome.samples] == [
            (True, j, 5), (False, j, 5), (False, j, 5)]
        assert [r.response for r in outcome.samples] == [
            greedy[j].text, *(s.text for s in sampled[2 * j:2 * j + 2])]
    assert len(recording.calls) == 2  # nothing else played
