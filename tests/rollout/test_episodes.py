"""The episode loop on the tiny model in-process: one token sequence per episode with the
policy's tokens masked in and the environment's out, exact log-probs, budgets, and
environments that are async, slow or raise."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import TorchEngineConfig
from rollout.engines.torch_engine import TorchEngine
from rollout.episodes import Episode
from rollout.turns import TurnFormat
from tests.rollout.episode_play import SAMPLING, play


@pytest.fixture(scope="module")
def engine(tiny_model_path: str) -> TorchEngine:
    return TorchEngine(TorchEngineConfig(batch_size=8), tiny_model_path)


def segments(episode: Episode) -> list[tuple[int, list[int]]]:
    """The response as runs of equal mask: (mask, token ids)."""
    runs: list[tuple[int, list[int]]] = []
    for token, mask in zip(episode.response_ids, episode.response_mask, strict=True):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return runs


def test_an_episode_is_one_sequence_with_the_policy_tokens_masked_in(
        engine: TorchEngine, turns: TurnFormat, tiny_model_path: str) -> None:
    episodes, _ = play(engine, turns, ["a", "b", "c", "d"], "Countdown", max_turns=4)
    tokenizer = turns.tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    for episode in episodes:
        label = episode.record["label"]
        assert episode.prompt_ids == turns.first(f"start {label}:")
        runs = segments(episode)
        # action, obs1, action, obs2, action: the third step said done, nothing after it
        assert [mask for mask, _ in runs] == [1, 0, 1, 0, 1]
        assert [tokenizer.decode(ids) for mask, ids in runs if mask == 0] == ["obs1:", "obs2:"]
        assert (episode.turns, episode.observations, episode.env_done) == (3, 2, True)
        assert episode.tool_calls == 2  # the environment's own count, read at the end
        assert episode.reward == pytest.approx(0.75)  # the sum of the three steps' rewards
        # Each step's reward sits on the last token of its action (GAE's per-turn credit).
        ends, position = [], -1
        for mask, ids in runs:
            position += len(ids)
            if mask == 1:
                ends.append(position)
        assert episode.turn_rewards == [(end, 0.25) for end in ends]
        holes = [lp for lp, m in zip(episode.log_probs, episode.response_mask, strict=True)
                 if m == 0]
        assert holes == [0.0] * len(holes)
        # The engine's log-probs of the action tokens are what a teacher-forced pass over
        # the whole sequence computes: what the trainer recomputes.
        ids = torch.tensor([episode.prompt_ids + episode.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(episode.prompt_ids) - 1:-1].float()
        forced = logits.log_softmax(-1).gather(-1, ids[0, len(episode.prompt_ids):, None])[:, 0]
        action = torch.tensor(episode.response_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(episode.log_probs)[action], forced[action],
                              atol=1e-5, rtol=0)


def test_max_turns_and_the_token_budget_end_an_episode(engine: TorchEngine,
                                                       turns: TurnFormat) -> None:
    episodes, _ = play(engine, turns, ["a", "b"], "Countdown", max_turns=2,
                       kwargs={"turns": 5})
    for episode in episodes:  # the second step's observation has no turn to read it
        assert [mask for mask, _ in segments(episode)] == [1, 0, 1]
        assert (episode.turns, episode.env_done, episode.reward) == (2, False, 0.5)
    episodes, _ = play(engine, turns, ["a"] * 4, "Chatty", max_turns=8, max_total_tokens=40,
                       kwargs={"words": 3})
    for episode in episodes:
        assert len(episode.response_ids) <= 40
        assert episode.turns < 8 and not episode.env_done  # the budget ended it
    episodes, _ = play(engine, turns, ["a"] * 2, "Chatty", max_turns=8, max_total_tokens=40)
    for episode in episodes:  # 249 characters of answer never fit: one turn, no hole
        assert (episode.turns, episode.observations, episode.tool_calls) == (1, 0, None)
        assert episode.response_mask == [1] * len(episode.response_ids)


def test_an_async_environment_plays_the_same_episodes(engine: TorchEngine,
                                                      turns: TurnFormat) -> None:
    plain, _ = play(engine, turns, ["a", "b", "c"], "Countdown", seed=4)
    awaited, _ = play(engine, turns, ["a", "b", "c"], "AsyncCountdown", seed=4)
    for one, other in zip(plain, awaited, strict=True):
        assert (one.prompt_ids, one.response_ids, one.response_mask, one.reward) == (
            other.prompt_ids, other.response_ids, other.response_mask, other.reward)


@pytest.mark.parametrize("env", ["SlowOnLabel", "AsyncSlowOnLabel"])
def test_a_slow_step_times_out_and_ends_only_its_episode(engine: TorchEngine,
                                                         turns: TurnFormat, env: str) -> None:
    started = time.perf_counter()
    episodes, env_seconds = play(engine, turns, ["ok", "slow", "ok"], env,
                                 step_timeout_s=0.3, kwargs={"seconds": 5.0})
    assert time.perf_counter() - started < 4.0  # never waited for the slow call
    ok, slow, ok_too = episodes
    assert slow.failure == (f"{env}.step: no answer within rollout.environment."
                            "step_timeout_s=0.3 s")
    assert (slow.reward, slow.turns) == (0.0, 1)
    assert ok.failure is None and ok_too.failure is None
    assert ok.reward == ok_too.reward == pytest.approx(0.75)
    assert 0.3 <= env_seconds < 4.0


def test_environment_calls_of_a_turn_run_concurrently(engine: TorchEngine,
                                                      turns: TurnFormat) -> None:
    episodes, env_seconds = play(engine, turns, ["slow"] * 8, "SlowOnLabel",
                                 kwargs={"seconds": 0.2, "turns": 2})
    assert all(e.failure is None and e.reward == 0.5 for e in episodes)
    assert env_seconds < 8 * 2 * 0.2 / 2  # 8 episodes × 2 steps of 0.2 s, not one by one


def test_a_raising_environment_ends_only_its_episode(engine: TorchEngine,
                                                     turns: TurnFormat) -> None:
    ok, reset, step, malformed = play(engine, turns, ["ok", "reset", "step", "malformed"],
                                      "RaisesOnLabel")[0]
    assert ok.failure is None and ok.reward == pytest.approx(0.75)
    assert reset.failure == "RaisesOnLabel.reset: KeyError: 'no such board'"
    assert reset.response_mask == [0] and reset.reward == 0.0 and reset.turns == 0
    assert step.failure == "RaisesOnLabel.step: ValueError: the tool crashed"
    # its first step's 0.25 is gone: a failed episode's reward is 0; its tokens stay
    assert (step.reward, step.turns) == (0.0, 2)
    assert [mask for mask, _ in segments(step)] == [1, 0, 1]
    assert malformed.failure.startswith("RaisesOnLabel.step: returned ('only two', 1.0), "
                                        "expected (observation: str | None")
    assert malformed.reward == 0.0


def test_each_turn_keeps_within_the_episode_budget_and_the_context(
        engine: TorchEngine, turns: TurnFormat) -> None:
    """A prompt that fills its budget (P = C − R): a turn given more tokens than its
    episode has left would run past the model's context."""
    budget = 24
    context = len(turns.first("talk:")) + budget
    calls: list[tuple[int, int]] = []
    episodes, _ = play(engine, turns, ["a"] * 8, "Chatty", max_turns=8,
                       max_total_tokens=budget, kwargs={"words": 1}, context=context,
                       calls=calls)
    assert all(longest + num_tokens <= context for longest, num_tokens in calls), calls
    assert len(calls) > max(e.turns for e in episodes)  # some turn needed a second call
    for episode in episodes:
        assert len(episode.prompt_ids) + len(episode.response_ids) <= context
        used = 0
        for mask, ids in segments(episode):  # an action keeps what was left before it
            assert mask == 0 or len(ids) <= min(SAMPLING.max_new_tokens, budget - used)
            used += len(ids)


def test_a_hung_environment_holds_a_bounded_number_of_threads(
        engine: TorchEngine, turns: TurnFormat, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step hangs past its timeout, rollout after rollout: the threads they hold
    are the pool's MAX_ENV_THREADS, reused, never a new set per rollout."""
    from rollout import episodes as loop
    from tests.rollout.toy_envs import RELEASE

    monkeypatch.setattr(loop, "MAX_ENV_THREADS", 3, raising=False)
    monkeypatch.setattr(loop, "_threads", None, raising=False)  # a pool of 3

    def env_threads() -> int:
        return sum(t.name.startswith("tally-env") for t in threading.enumerate())

    before = env_threads()
    RELEASE.clear()
    try:
        for _ in range(4):  # 4 rollouts × 3 episodes: 12 hung calls, 3 threads
            played, _ = play(engine, turns, ["x"] * 3, "BlocksOnStep", step_timeout_s=0.05)
            assert all(e.failure is not None and "step_timeout_s=0.05" in e.failure
                       for e in played)
            assert env_threads() - before <= 3
    finally:
        RELEASE.set()
        if getattr(loop, "_threads", None) is not None:
            loop._threads.shutdown(wait=True)


def test_a_prompt_over_its_budget_plays_within_the_context(engine: TorchEngine,
                                                           turns: TurnFormat) -> None:
    """The context holds 3 tokens past the prompt while a turn may keep 6: the turn's
    call asks for 3 (it looped forever asking for 6), and an episode whose context is
    full ends."""
    context = len(turns.first("talk:")) + 3
    calls: list[tuple[int, int]] = []
    episodes, _ = play(engine, turns, ["a"] * 2, "Chatty", max_turns=4, max_total_tokens=24,
                       kwargs={"words": 1}, context=context, calls=calls)
    assert calls and all(longest + num_tokens <= context for longest, num_tokens in calls)
    for episode in episodes:
        assert len(episode.prompt_ids) + len(episode.response_ids) <= context
        assert episode.ended and not episode.env_done
