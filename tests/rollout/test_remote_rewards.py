"""Remote rewards that survive (rollout/remote.py): a ``type: http`` reward endpoint and a
judge on an OpenAI-compatible server, against real HTTP servers on loopback
(tests/rollout/chat_server.py) that fail as they are told.

The reference of every score is the endpoint's function called here directly; the
reference of the backoff is its documented bound, delay_k ∈ backoff_s · 2^k · [0.5, 1]."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from rollout.judge import ask_server, judge_request
from rollout.remote import CallTally, RemoteOutage, RemoteRefused
from rollout.reward_config import HttpRewardConfig, JudgeConfig
from rollout.reward_parts import RewardShard, build_parts
from rollout.reward_parts.base import PartScores, RewardPart
from services.driver.loop import failure
from tests.rollout.chat_server import ChatHandler, RewardHandler, fresh, serving

PROMPTS = [f"question {i}?" for i in range(10)]
RESPONSES = ["4", "four", "", "it is 7", "7", "x" * 9, "abc", "no idea", "12", "1 2"]
LABELS: list[str | None] = ["4", "4", "1", "7", "7", None, "abc", "3", "12", None]
SHARDS = [RewardShard(PROMPTS[a:b], PROMPTS[a:b], RESPONSES[a:b], LABELS[a:b],
                      [{} for _ in range(a, b)]) for a, b in ((0, 6), (6, 10))]
BATCH = 4  # samples per request: shards of 6 and 4 make requests of 4, 2 and 4


def endpoint_score(prompt: str, response: str, label: str | None) -> float:
    """What the loopback endpoint answers for one sample."""
    matched = label is not None and response.strip() == label
    return 2.0 * matched - 0.125 * len(response) + 0.01 * len(prompt)


REFERENCE = [endpoint_score(p, r, lb) for p, r, lb in zip(PROMPTS, RESPONSES, LABELS,
                                                          strict=True)]


class _Rewards(RewardHandler):
    def reward(self, prompt: str, response: str, label: str | None) -> float:
        return endpoint_score(prompt, response, label)


def _part(url: str, **fields: Any) -> RewardPart:
    config = HttpRewardConfig.model_validate({
        "url": f"{url}/get_reward", "batch_size": BATCH, "max_concurrency": 1,
        "timeout_s": 5, "backoff_s": 0.02, "max_retries": 3, **fields})
    [part] = build_parts([config])
    part.bind([])
    return part


def _scored(part: RewardPart) -> PartScores:
    return part.collect([part.submit(shard) for shard in SHARDS])


def _free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_endpoint_gets_openrlhf_batches_and_its_scores_come_back_in_order() -> None:
    handler = fresh(_Rewards)
    with serving(handler) as url:
        scores = _scored(_part(url))
    assert scores.values == pytest.approx(REFERENCE, abs=0)
    assert scores.counts == {"failed_calls": 0, "retries": 0, "unscored": 0}
    bodies = [r["body"] for r in handler.received]
    assert [len(b["query"]) for b in bodies] == [4, 2, 4]
    first = bodies[0]
    assert first["query"] == [p + r for p, r in zip(PROMPTS[:4], RESPONSES[:4], strict=True)]
    assert (first["prompts"], first["responses"], first["labels"]) == (
        PROMPTS[:4], RESPONSES[:4], LABELS[:4])
    assert {r["path"] for r in handler.received} == {"/get_reward"}
    assert all("Authorization" not in r["headers"] for r in handler.received)


@pytest.mark.parametrize("failures", [[503, 503], [429, 500], ["hang"]],
                         ids=["503-twice", "429-then-500", "timeout"])
def test_retryable_failures_leave_the_scores_of_a_run_without_them(failures: list) -> None:
    with serving(fresh(_Rewards)) as url:
        clean = _scored(_part(url))
    handler = fresh(_Rewards, failures=failures, hang_s=1.5)
    with serving(handler) as url:
        survived = _scored(_part(url, timeout_s=0.5))
    assert survived.values == clean.values == pytest.approx(REFERENCE, abs=0)
    assert survived.counts == {"failed_calls": 0, "retries": len(failures), "unscored": 0}
    assert len(handler.received) == 3 + len(failures)


def test_a_judge_server_that_returns_503_twice_answers_as_one_that_never_failed() -> None:
    class Grader(ChatHandler):
        def answer(self, body: dict) -> str:
            text = body["messages"][0]["content"]
            return f"Score: {len(re.search(r'A: (.*)', text).group(1))}"

    config = JudgeConfig(url="http://127.0.0.1:1", template="Q: {prompt}\nA: {response}",
                         parse=r"Score: (\d+)", backoff_s=0.02, max_concurrency=2,
                         server_model="judge-7b")
    requests = [judge_request(config.template, p, r, lb)
                for p, r, lb in zip(PROMPTS, RESPONSES, LABELS, strict=True)]
    with serving(fresh(Grader)) as url:
        clean = ask_server(config.model_copy(update={"url": url}), requests)
    handler, tally = fresh(Grader, failures=[503, 503]), CallTally()
    with serving(handler) as url:
        survived = ask_server(config.model_copy(update={"url": url}), requests, tally=tally)
    assert survived == clean == [f"Score: {len(r)}" for r in RESPONSES]
    assert tally.counts() == {"failed_calls": 0, "retries": 2}
    assert {r["path"] for r in handler.received} == {"/v1/chat/completions"}
    assert {r["body"]["model"] for r in handler.received} == {"judge-7b"}


def test_a_dead_endpoint_leaves_every_sample_unscored_after_bounded_backoff() -> None:
    handler = fresh(_Rewards, fail_always=503)
    backoff, retries = 0.2, 3
    with serving(handler) as url:
        started = time.monotonic()
        scores = _scored(_part(url, backoff_s=backoff, max_retries=retries,
                               max_unscored_fraction=1.0))
        took = time.monotonic() - started
    assert scores.values == [None] * len(REFERENCE)
    assert scores.counts == {"failed_calls": 3, "retries": 3 * retries,
                             "unscored": len(REFERENCE)}
    assert len(handler.received) == 3 * (retries + 1)
    # one request in flight at a time: each call's attempts are consecutive arrivals
    times = [r["at"] for r in handler.received]
    for call in range(3):
        gaps = [times[call * 4 + k + 1] - times[call * 4 + k] for k in range(retries)]
        for k, gap in enumerate(gaps):
            assert 0.5 * backoff * 2**k <= gap <= backoff * 2**k + 0.3  # + a busy CPU
    assert took <= 3 * backoff * (2**retries - 1) + 2.0

    port = _free_port()  # refused connections are retried the same way
    refused = _part(f"http://127.0.0.1:{port}", backoff_s=0.01, max_retries=2,
                    max_unscored_fraction=1.0)
    scores = _scored(refused)
    assert scores.values == [None] * len(REFERENCE)
    assert scores.counts == {"failed_calls": 3, "retries": 6, "unscored": len(REFERENCE)}


def test_a_401_is_not_retried_and_a_refused_step_is_no_fault() -> None:
    handler = fresh(_Rewards, fail_always=401)
    with serving(handler) as url:
        scores = _scored(_part(url, max_unscored_fraction=1.0))
        assert scores.values == [None] * len(REFERENCE)
        assert scores.counts == {"failed_calls": 3, "retries": 0,
                                 "unscored": len(REFERENCE)}
        assert len(handler.received) == 3  # one try per request
        with pytest.raises(RemoteRefused, match=r"reward http: 10/10 samples unscored .*"
                           r"HTTP 401"):
            _scored(_part(url, max_unscored_fraction=0.5))
    judge = JudgeConfig(url=url, backoff_s=0.01)  # the server is gone: refused, retried
    tally = CallTally()
    assert ask_server(judge, ["a", "b"], tally=tally) == [None, None]
    assert tally.counts() == {"failed_calls": 2, "retries": 2 * judge.max_retries}


def _raised_in_the_manager(err: Exception) -> Exception:
    return ray.exceptions.RayTaskError(
        "generate_batch", 'Traceback (most recent call last):\n  File "m.py", line 1\n',
        err, proctitle="ray::RolloutManager.generate_batch").as_instanceof_cause()


def test_a_sustained_outage_fails_the_step_as_a_fault_the_driver_restarts() -> None:
    """Past max_unscored_fraction the step raises RemoteOutage, which the driver's own
    classification (services/driver/loop.failure) calls a fault; a refusal, or any other
    error a part raises, is not."""
    failures = [503] * 4  # the first request's four tries: 4 of 10 samples unscored
    with serving(fresh(_Rewards, failures=failures)) as url:
        part = _part(url, max_unscored_fraction=0.4, max_retries=3)
        scores = _scored(part)  # 4/10 = 0.4: allowed
        assert scores.values == [None] * 4 + REFERENCE[4:]
    with serving(fresh(_Rewards, failures=failures)) as url, pytest.raises(
            RemoteOutage, match=r"reward http: 4/10 samples unscored .*HTTP 503 Service "
            r"Unavailable after 3 retries") as outage:
        _scored(_part(url, max_unscored_fraction=0.3, max_retries=3))
    line, fault = failure(_raised_in_the_manager(outage.value))
    assert fault and line.startswith("RolloutManager.generate_batch failed: RemoteOutage: "
                                     "reward http: 4/10 samples unscored")
    assert not failure(_raised_in_the_manager(RemoteRefused("401")))[1]
    assert not failure(_raised_in_the_manager(RuntimeError("a bug")))[1]


KEY = "sk-test-0123456789abcdef"


def test_the_key_comes_from_a_0600_file_or_the_environment_and_only_goes_to_the_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match=r"rollout.reward\[0\].api_key_file: .* readable "
                       r"or writable by group or others \(mode 644\); chmod 600"):
        build_parts([HttpRewardConfig(url="http://h:1/r", api_key_file=str(key_file))]
                    )[0].check("rollout.reward[0]")
    link = tmp_path / "link"
    link.symlink_to(key_file)
    key_file.chmod(0o600)
    with pytest.raises(ValueError, match="link is refused"):
        build_parts([HttpRewardConfig(url="http://h:1/r", api_key_file=str(link))]
                    )[0].check("f")

    handler = fresh(_Rewards)
    with serving(handler) as url:
        by_file = _part(url, api_key_file=str(key_file))
        by_file.check("rollout.reward[0]")
        assert _scored(by_file).values == pytest.approx(REFERENCE, abs=0)
        monkeypatch.setenv("TALLY_TEST_KEY", KEY)
        assert _scored(_part(url, api_key_env="TALLY_TEST_KEY")).values == pytest.approx(
            REFERENCE, abs=0)
        monkeypatch.delenv("TALLY_TEST_KEY")
        with pytest.raises(ValueError, match=r"reward http.api_key_env: \$TALLY_TEST_KEY "
                           "is not set"):
            _part(url, api_key_env="TALLY_TEST_KEY")
    assert {r["headers"]["Authorization"] for r in handler.received} == {f"Bearer {KEY}"}
    with pytest.raises(ValueError, match="api_key_env: 'sk-abc-1' is not an environment "
                       "variable's name"):
        HttpRewardConfig(url="http://h:1/r", api_key_env="sk-abc-1")
    with pytest.raises(ValueError, match="api_key_file: give api_key_env or api_key_file"):
        JudgeConfig(url="http://h:1", api_key_env="K", api_key_file=str(key_file))
    assert KEY not in repr(_part("http://h:1", api_key_file=str(key_file)).__dict__)


def test_no_file_a_scored_step_writes_holds_the_key(tmp_path: Path) -> None:
    """The part-level run: the config, the scores and counts as the driver writes them
    (services/driver/sinks, samples), and the failures' messages hold no key."""
    from services.driver.sinks import JsonlSink

    key_file = tmp_path / "secret" / "key"
    key_file.parent.mkdir()
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    out = tmp_path / "job"
    out.mkdir()
    with serving(fresh(_Rewards, failures=[503] * 4 + [401])) as url:
        part = _part(url, api_key_file=str(key_file), max_unscored_fraction=1.0)
        handles = [part.submit(shard) for shard in SHARDS]
        scores = part.collect(handles)
    (out / "config.json").write_text(part.config.model_dump_json())
    sink = JsonlSink(out)
    sink.write(0, {f"reward/{part.name}/{k}": float(v) for k, v in scores.counts.items()})
    sink.close()
    tally = CallTally()
    for _, shard_tally in handles:
        tally.add(shard_tally)
    assert tally.first_error is not None and "HTTP 503" in tally.first_error
    (out / "errors.txt").write_text(f"{tally.first_error}\n{scores!r}")
    assert scores.counts == {"failed_calls": 2, "retries": 3,
                             "unscored": sum(v is None for v in scores.values)}
    written = [p for p in out.rglob("*") if p.is_file()]
    assert len(written) == 3 and all(KEY not in p.read_text() for p in written)
    assert str(key_file) in (out / "config.json").read_text()  # its path, not its content
    assert os.stat(key_file).st_mode & 0o777 == 0o600
