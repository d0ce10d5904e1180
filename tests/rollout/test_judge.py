"""LLM judges: the request each sample sends, the parse of an answer, a judge served by a
torch engine actor in a rollout (its answers recomputed here with the same engine), and
the SGLang server path over HTTP (a local server speaking the OpenAI chat protocol)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import ClassVar

import pytest
import ray

from rollout.config import RolloutConfig, TorchEngineConfig
from rollout.judge import JudgeEngine, ask_server, judge_request, parse_score
from rollout.manager import RolloutManagerActor
from rollout.reward_config import JudgeConfig
from services.runtime.gang import start_rollout_actors
from tests.rollout.chat_server import ChatHandler, serving


def test_built_in_parse_reads_the_last_number_up_to_ten() -> None:
    assert parse_score("I'd give it 7/10.", "0-10") == 0.7
    assert parse_score("Score: 10", "0-10") == 1.0
    assert parse_score("0", "0-10") == 0.0
    assert parse_score("about 7.5", "0-10") == 0.75  # tests/rollout/test_judge_parse.py
    assert parse_score("42 is wrong", "0-10") is None
    assert parse_score("no idea", "0-10") is None


def test_yes_no_parse_reads_the_first_word() -> None:
    assert parse_score("Yes, the answer is correct.", "yes-no") == 1.0
    assert parse_score(" No. It is 8.", "yes-no") == 0.0
    assert parse_score("Maybe yes", "yes-no") is None
    assert parse_score("", "yes-no") is None


def test_regex_parse_reads_its_first_group() -> None:
    assert parse_score("Verdict: 0.25 (fine)", r"Verdict: ([0-9.]+)") == 0.25
    assert parse_score("Verdict: none", r"Verdict: ([0-9.]+)") is None
    assert parse_score("Verdict: 1.2.3", r"Verdict: ([0-9.]+)") is None


def test_request_fills_prompt_response_and_label() -> None:
    template = "Q: {prompt}\nA: {response}\nRef: {label} {{braces}}"
    assert judge_request(template, "2+2?", "4", "4") == "Q: 2+2?\nA: 4\nRef: 4 {braces}"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert judge_request(template, messages, "yo", None) == "Q: be brief\nhi\nA: yo\nRef:  {braces}"


PARSE = r"([0-9])"  # the tiny judge repeats the response's last character: some digits


@pytest.fixture(scope="module")
def judged(ray_cluster: None, tiny_model_path: str) -> Iterator[tuple]:
    config = RolloutConfig.model_validate({
        "dataset": {"type": "synthetic", "task": "copy", "num_prompts": 6, "seed": 1},
        "sampling": {"max_new_tokens": 5},
        "n_samples_per_prompt": 4, "global_batch_size": 16, "seed": 2,
        "reward": [{"type": "exact_match"},
                   {"type": "judge", "name": "judge", "model": tiny_model_path,
                    "template": "{prompt}{response}", "parse": PARSE,
                    "max_new_tokens": 6, "num_cpus": 0, "num_actors": 2, "weight": 0.5}]})
    actors = start_rollout_actors(config, tiny_model_path)
    actor = RolloutManagerActor.remote(config, tiny_model_path, engines=actors.engines,
                                       owns_engines=True, teachers=actors.teachers,
                                       reward_actors=actors.reward_actors, samples_per_step=16)
    batch = ray.get(actor.generate_batch.remote(0))
    yield config, batch
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


@pytest.mark.slow  # a manager, its engine and two judge engines on Ray
def test_a_judge_in_the_gang_scores_what_its_engine_answers(judged: tuple,
                                                            tiny_model_path: str) -> None:
    config, batch = judged
    part = config.reward_parts[1]
    engine = JudgeEngine(TorchEngineConfig(num_threads=1, prefix_cache_mb=0),
                         tiny_model_path, tiny_model_path)
    requests = [judge_request(part.template, s.record_prompt, s.response, s.label)
                for s in batch.samples]
    answers, _ = engine.answer(requests, part.max_new_tokens)
    expected = [parse_score(a, PARSE) for a in answers]
    assert None in expected and any(e is not None for e in expected)  # both kinds seen
    assert [s.rewards["judge"] for s in batch.samples] == expected  # None: unscored
    assert batch.metadata["reward/judge/unparsed"] == float(sum(
        e is None for e in expected))
    assert batch.metadata["reward/judge/unscored"] == batch.metadata["reward/judge/unparsed"]
    assert batch.scored.tolist() == [e is not None for e in expected]
    # the raw answer travels to samples.jsonl beside the score it gave
    assert [s.judge_answers for s in batch.samples] == [{"judge": a} for a in answers]
    for i, sample in enumerate(batch.samples):
        assert sample.index == i
        if expected[i] is None:  # missing, not zero: no reward, advantage 0
            assert sample.reward is None and float(batch.rewards[i]) == 0.0
            assert not batch.advantages[i].any()
        else:
            assert sample.reward == pytest.approx(sample.rewards["exact_match"]
                                                  + 0.5 * sample.rewards["judge"])


class _ChatServer(ChatHandler):
    """The OpenAI chat endpoint as SGLang serves it: the answer grades the response by
    its length, so the test sees which request each answer belongs to."""

    seen: ClassVar[list[dict]] = []

    def answer(self, body: dict) -> str:
        type(self).seen.append({"path": self.path, **body})
        response = re.search(r"A: (.*)\n", body["messages"][0]["content"]).group(1)
        return f"Score: {len(response)}" if response != "unparsable" else "dunno"


def test_the_server_path_sends_greedy_chat_requests_and_keeps_their_order() -> None:
    with serving(_ChatServer) as url:
        config = JudgeConfig(url=url, template="Q: {prompt}\nA: {response}\n",
                             parse=r"Score: (\d+)", max_new_tokens=9, timeout_s=10)
        responses = ["x" * n for n in range(12)] + ["unparsable"]
        requests = [judge_request(config.template, "p", r, None) for r in responses]
        answers = ask_server(config, requests, workers=4)
        assert [parse_score(a, config.parse) for a in answers] == [
            float(n) for n in range(12)] + [None]
        seen = _ChatServer.seen
        assert {s["path"] for s in seen} == {"/v1/chat/completions"}
        assert all(s["temperature"] == 0.0 and s["max_tokens"] == 9 for s in seen)


def test_a_dead_server_leaves_the_sample_unscored_after_its_retries() -> None:
    """Refused connections are retried (rollout/remote.py), then the answer is None: an
    unscored sample, not an error (tests/rollout/test_remote_rewards.py has the rest)."""
    from rollout.remote import CallTally

    config = JudgeConfig(url="http://127.0.0.1:9", timeout_s=2, backoff_s=0.01)
    tally = CallTally()
    assert ask_server(config, ["hi {response}"], tally=tally) == [None]
    assert tally.counts() == {"failed_calls": 1, "retries": config.max_retries}


def test_a_judge_server_down_for_more_than_its_share_of_a_step_is_an_outage() -> None:
    """Through the part (what the Rewarder calls): failed calls count, and more unscored
    samples than max_unscored_fraction raise RemoteOutage, the fault the driver restarts
    from its checkpoint; within the share the samples are only unscored."""
    from rollout.remote import RemoteOutage
    from rollout.reward_parts.base import RewardShard
    from rollout.reward_parts.judge import JudgePart

    def run(fraction: float):
        part = JudgePart(JudgeConfig(url="http://127.0.0.1:9", timeout_s=2, backoff_s=0.01,
                                     max_retries=1, max_unscored_fraction=fraction))
        part.bind([])
        shard = RewardShard(["p", "q"], ["p", "q"], ["a", "b"], ["a", "b"], [{}, {}])
        return part.collect([part.submit(shard)])

    with pytest.raises(RemoteOutage, match=r"2/2 samples unscored by failed calls"):
        run(0.5)
    scores = run(1.0)
    assert scores.values == [None, None]
    assert scores.counts == {"unparsed": 0, "unscored": 2, "over_budget": 0, "failed_calls": 2,
                             "retries": 2}
