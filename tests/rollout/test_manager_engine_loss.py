"""An engine lost under the rollout manager (rollout/engine_pool.py), on real Ray with two
tiny torch engines: its shard is re-run on the live engine with the seed it was given, so
the batch is the one both engines would have made; a weight load goes on without it; the
gang's replacement loads the current weights and serves its rank's shards again; a hung
engine is lost at rollout.generate_timeout_s; the last live engine lost raises."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from rollout.batch import RolloutBatch
from rollout.config import RolloutConfig
from rollout.manager import RolloutManager
from services.runtime.gang import start_engine, start_rollout_actors
from tests.services.driver.clean_run import wait_until_dead

CONFIG = RolloutConfig.model_validate({
    "dataset": {"type": "synthetic", "task": "copy", "num_prompts": 8, "seed": 1},
    "engine": {"type": "torch", "num_engines": 2, "batch_size": 8},
    "sampling": {"max_new_tokens": 6},
    "n_samples_per_prompt": 4,
    "global_batch_size": 16,
    "seed": 3,
})


@pytest.fixture
def manager(ray_cluster: None, tiny_model_path: str) -> Iterator[RolloutManager]:
    actors = start_rollout_actors(CONFIG, tiny_model_path)
    try:
        manager = RolloutManager(CONFIG, tiny_model_path, engines=actors.engines,
                                 owns_engines=True, teachers=[], reward_actors={})
    except BaseException:
        actors.stop()
        raise
    yield manager
    for engine in manager.engines:
        ray.kill(engine)
    actors.stop()


def assert_same(a: RolloutBatch, b: RolloutBatch) -> None:
    for name in ("input_ids", "loss_mask", "rollout_log_probs", "rewards", "group_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def kill(engine: ray.actor.ActorHandle) -> None:
    ray.kill(engine)
    wait_until_dead(engine.ping.remote)


def pid_of(engine: ray.actor.ActorHandle) -> int:
    return ray.get(engine.__ray_call__.remote(lambda _: os.getpid()), timeout=60)


@pytest.mark.slow  # three engine starts
def test_a_lost_engines_shard_is_rerun_with_its_seed_and_its_replacement_loads_the_weights(
        manager: RolloutManager, tiny_model_path: str, other_tiny_model_path: str) -> None:
    state = manager.state_dict()
    other = ray.put(AutoModelForCausalLM.from_pretrained(other_tiny_model_path).state_dict())
    manager.update_weights([other])
    want = manager.generate_batch(4)  # both engines, the other model's weights
    manager.update_weights_from_disk(tiny_model_path)  # back to the start's weights

    kill(manager.engines[1])
    assert manager.update_weights([other]) == 3  # engine 0 loads; engine 1 is lost
    lost = manager.lost_engines()
    assert [rank for rank, _ in lost] == [1]
    manager.load_state_dict(state)
    got = manager.generate_batch(4)  # rank 1's shard on engine 0, with rank 1's seed
    assert_same(got, want)
    assert got.metadata["rollout/engines_lost"] == 1.0
    assert [kind for kind, _ in got.events] == ["engine_lost"]
    assert "engine 1 lost" in got.events[0][1]

    replacement = start_engine(CONFIG, tiny_model_path, 1)  # the start's weights
    manager.replace_engine(1, replacement)
    assert manager.lost_engines() == []
    kill(manager.engines[0])  # now the replacement alone plays both ranks' shards
    manager.load_state_dict(state)
    again = manager.generate_batch(4)
    assert_same(again, want)  # it loaded the other model's weights, the current ones
    assert [rank for rank, _ in manager.lost_engines()] == [0]

    kill(replacement)  # the last live engine: nothing can re-run its shard
    manager.load_state_dict(state)
    with pytest.raises(ray.exceptions.RayActorError):
        manager.generate_batch(4)


@pytest.mark.slow  # two engine starts and a 10 s wait
def test_an_engine_past_the_generate_timeout_is_lost_and_its_shard_rerun(
        ray_cluster: None, tiny_model_path: str) -> None:
    """Engine 0 stopped (SIGSTOP: alive, never answering): past generate_timeout_s it is
    killed and its shard is played by engine 1, giving the batch of a run without it."""
    config = CONFIG.model_copy(update={"generate_timeout_s": 10.0})
    actors = start_rollout_actors(config, tiny_model_path)
    stopped: list[int] = []
    try:
        manager = RolloutManager(config, tiny_model_path, engines=actors.engines,
                                 owns_engines=True, teachers=[], reward_actors={})
        state = manager.state_dict()
        want = manager.generate_batch(0)
        pid = pid_of(actors.engines[0])
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        manager.load_state_dict(state)
        got = manager.generate_batch(0)
        assert_same(got, want)
        (event,) = got.events
        assert event[0] == "engine_lost"
        assert "rollout.generate_timeout_s=10 s" in event[1]
        wait_until_dead(actors.engines[0].ping.remote)  # the manager killed it
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        actors.stop()


@pytest.mark.slow  # two engine starts
def test_engines_the_manager_does_not_own_are_never_taken_for_lost(
        ray_cluster: None, tiny_model_path: str) -> None:
    """Trainer ranks serving as engines (the colocated fast path) are handed with
    owns_engines False: a loss raises, and the job restarts, as before."""
    actors = start_rollout_actors(CONFIG, tiny_model_path)
    try:
        manager = RolloutManager(CONFIG, tiny_model_path, engines=actors.engines,
                                 owns_engines=False, teachers=[], reward_actors={})
        kill(actors.engines[1])
        with pytest.raises(ray.exceptions.RayActorError):
            manager.generate_batch(0)
        assert manager.lost_engines() == []
    finally:
        actors.stop()
