"""The trainer group on a real Ray cluster: ranks meet at rank 0's store (a port rank 0
bound itself), an export hands back rank 0's weights by reference, and a rank that dies
fails the export at once with ``TrainerRankDied`` (what the driver restarts on) while its
peer sits in the collective waiting for it."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from rollout.tiny import create_tiny_checkpoint
from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.group import TrainerGroup, TrainerRankDied

COLLECTIVE_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _kill(worker: ray.actor.ActorHandle, timeout_s: float = 60.0) -> None:
    """Kill a rank's actor and wait until Ray reports it dead, so the next call surely
    meets a dead rank (``ray.kill`` returns before the actor is gone)."""
    ray.kill(worker)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(worker.node_id.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed rank still answers")


@pytest.mark.slow
def test_a_dead_rank_fails_the_export_with_trainer_rank_died(ray_cluster: None,
                                                              tiny_model: str) -> None:
    config = TrainerConfig(dp_size=2, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                           call_timeout_s=2 * COLLECTIVE_TIMEOUT_S)
    group = TrainerGroup(config, ObjectiveConfig(), tiny_model, total_steps=1)
    try:
        ref = group.async_export_weights()
        assert isinstance(ref, ray.ObjectRef)
        state = ray.get(ref)
        assert state and all(isinstance(v, torch.Tensor) for v in state.values())

        _kill(group.workers[1])
        started = time.monotonic()
        with pytest.raises(TrainerRankDied, match="trainer rank 1 died during export_weights"):
            group.async_export_weights()
        # Rank 0 is stuck in the gather; the group did not wait for it to time out.
        assert time.monotonic() - started < COLLECTIVE_TIMEOUT_S / 2
    finally:
        group.shutdown()
