"""A 429 or 503 with ``Retry-After`` waits what the server asked before its retry
(rollout/remote.py, issue 52), never longer than one call's ``timeout_s``; another
status's header is not read. Against a real HTTP server on loopback
(tests/rollout/chat_server.py's handlers) that answers as told, timed by the server's own
record of when each request arrived."""

from __future__ import annotations

import email.utils
import itertools
import random
import time
import urllib.error
from email.message import Message
from typing import Any, ClassVar

import pytest

from rollout.remote import CallTally, RemoteSettings, post_json, retry_after_s, retry_delay
from rollout.reward_config import HttpRewardConfig
from rollout.reward_parts import RewardShard, build_parts
from tests.rollout.chat_server import RewardHandler, fresh, serving

BACKOFF_S = 0.01  # the backoff alone would retry within 10 ms


class _Told(RewardHandler):
    """Answers each request's status from ``told`` first: (status, Retry-After or None);
    then the reward 2 · len(response)."""

    told: ClassVar[list[tuple[int, str | None]]] = []

    def reward(self, prompt: str, response: str, label: str | None) -> float:
        return 2.0 * len(response)

    def do_POST(self) -> None:
        with type(self).lock:
            status, after = type(self).told.pop(0) if type(self).told else (None, None)
        if status is None:
            super().do_POST()
            return
        self.rfile.read(int(self.headers["Content-Length"]))
        with type(self).lock:
            type(self).received.append({"at": time.monotonic(), "status": status})
        self.send_response(status)
        if after is not None:
            self.send_header("Retry-After", after)
        self.send_header("Content-Length", "0")
        self.end_headers()


def _handler(told: list[tuple[int, str | None]]) -> type[_Told]:
    handler = fresh(_Told)
    handler.told = list(told)  # type: ignore[attr-defined]
    return handler  # type: ignore[return-value]


def _gaps(handler: type[Any]) -> list[float]:
    times = [r["at"] for r in handler.received]
    return [b - a for a, b in itertools.pairwise(times)]


def _post(url: str, timeout_s: float = 5.0) -> tuple[Any, CallTally]:
    settings = RemoteSettings(url, timeout_s, max_retries=3, backoff_s=BACKOFF_S,
                              max_concurrency=1)
    tally = CallTally()
    reply = post_json(settings, {"prompts": ["q"], "responses": ["abc"], "labels": [None],
                                 "query": ["qabc"]}, tally, num_samples=1,
                      rng=random.Random(0))
    return reply, tally


@pytest.mark.parametrize(("status", "after", "wait_s"),
                         [(429, "1", 1.0), (503, "0.6", 0.6), (500, "2", 0.0)])
def test_the_retry_waits_what_the_server_asked(status: int, after: str,
                                               wait_s: float) -> None:
    handler = _handler([(status, after)])
    with serving(handler) as url:
        reply, tally = _post(url + "/get_reward")
    assert reply == {"rewards": [6.0]}  # the retry's answer
    assert (tally.retries, tally.failed_calls) == (1, 0)
    [gap] = _gaps(handler)
    assert gap >= wait_s  # a 500's header is not read: the backoff alone (≤ 10 ms)
    assert gap < wait_s + 0.5


def test_a_longer_wait_than_a_call_may_take_is_capped_at_timeout_s() -> None:
    handler = _handler([(429, "3600"), (429, "3600")])
    with serving(handler) as url:
        started = time.monotonic()
        reply, tally = _post(url + "/get_reward", timeout_s=0.4)
        took = time.monotonic() - started
    assert reply == {"rewards": [6.0]} and tally.retries == 2
    assert all(0.4 <= gap < 0.9 for gap in _gaps(handler))
    assert took < 2.0


def test_an_http_part_that_is_told_to_wait_scores_as_one_never_told() -> None:
    """The part's own path (rollout/reward_parts/http.py): the scores of a run whose
    first call was answered 429 Retry-After 1 are those of a run without it."""
    responses = ["a", "bb", "", "dddd"]
    shard = RewardShard(["p"] * 4, ["p"] * 4, responses, [None] * 4, [{}] * 4)
    handler = _handler([(429, "1")])
    with serving(handler) as url:
        config = HttpRewardConfig(url=url + "/get_reward", backoff_s=BACKOFF_S,
                                  max_retries=2, timeout_s=5)
        [part] = build_parts([config])
        part.bind([])
        scores = part.collect([part.submit(shard)])
    assert scores.values == [2.0 * len(r) for r in responses]
    assert scores.counts["retries"] == 1 and scores.counts["failed_calls"] == 0
    assert _gaps(handler)[0] >= 1.0


def _error(code: int, after: str | None) -> urllib.error.HTTPError:
    headers = Message()
    if after is not None:
        headers["Retry-After"] = after
    return urllib.error.HTTPError("http://x", code, "told", headers, None)


def test_retry_after_reads_seconds_and_dates_and_nothing_else() -> None:
    now = 1_700_000_000.0
    in_90_s = email.utils.formatdate(now + 90, usegmt=True)
    assert retry_after_s(_error(429, "7"), now) == 7.0
    assert retry_after_s(_error(503, in_90_s), now) == pytest.approx(90.0)
    assert retry_after_s(_error(503, email.utils.formatdate(now - 5, usegmt=True)),
                         now) == 0.0  # a date past: no wait
    for err in (_error(429, None), _error(429, "soon"), _error(429, "nan"),
                _error(500, "7"), _error(404, "7"), TimeoutError()):
        assert retry_after_s(err, now) is None
    settings = RemoteSettings("http://x", timeout_s=30.0, max_retries=3, backoff_s=2.0,
                              max_concurrency=1)
    rng = random.Random(0)
    backoff = 2.0 * 2 ** 2 * random.Random(0).uniform(0.5, 1.0)
    assert retry_delay(None, 2, settings, random.Random(0)) == backoff
    assert retry_delay(0.5, 2, settings, random.Random(0)) == backoff  # the longer one
    assert retry_delay(20.0, 2, settings, rng) == 20.0
    assert retry_delay(1e6, 2, settings, rng) == 30.0  # capped at timeout_s
