"""A session's engine calls are bounded by rollout.call_timeout_s (services/sessions/
runtime.py ``_engine_get``): an answer in time is returned, a late one is a 504 the
client may send again, naming the setting."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from services.sessions.runtime import SessionError, TrainingSession


def _session(timeout_s: float) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(rollout=SimpleNamespace(
        call_timeout_s=timeout_s)))


def test_an_engine_call_past_its_timeout_is_a_retriable_504(ray_cluster: None) -> None:
    import ray

    @ray.remote(num_cpus=0)
    def answer(after_s: float) -> str:
        time.sleep(after_s)
        return "done"

    assert TrainingSession._engine_get(_session(60), answer.remote(0.0), "ping") == "done"
    session = _session(timeout_s=0.5)  # a worker is started now: in time is quick
    started = time.monotonic()
    with pytest.raises(SessionError) as raised:
        TrainingSession._engine_get(session, answer.remote(30.0), "generate")
    assert time.monotonic() - started < 10
    assert raised.value.status == 504 and raised.value.retriable
    assert "rollout.call_timeout_s=0.5" in str(raised.value)
    assert raised.value.problems[0].field == "engine"
