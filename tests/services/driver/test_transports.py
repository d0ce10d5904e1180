"""The weight transports behind one interface (services/driver/transports/), on a real
Ray cluster with real trainer ranks on gloo: each transport that runs on CPU delivers
exactly the trainer's weights of version v to a torch engine, which then serves v, and a
receiver asked for a version it was not sent refuses it, still serving the old one. The
GPU transports (nccl, cuda_ipc) are tests/gpu's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import ray
import torch

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.torch_engine import TorchEngine
from rollout.tiny import create_tiny_checkpoint
from rollout.weight_bucket import WeightVersionMismatch
from services.driver.transports import transport_for
from services.driver.transports.cuda_ipc import CudaIpcTransport
from services.driver.transports.in_process import InProcessTransport
from services.driver.transports.nccl import NcclTransport
from services.driver.transports.object_store import ObjectStoreTransport
from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.group import TrainerGroup
from trainer.transports.object_store import ObjectStoreSender

ENGINE = TorchEngineConfig(batch_size=4)
PROMPTS = [[1, 70, 84, 4, 69, 70, 33], [1, 69, 33]]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8)


class ReadableEngine(TorchEngine):
    """A torch engine whose served weights the test can read back."""

    def weights(self) -> dict[str, np.ndarray]:
        return {name: t.detach().clone().numpy() for name, t in
                self.model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _perturbed(group: Any, seed: int) -> dict[str, torch.Tensor]:
    """The group's weights moved by seeded noise, loaded into it (what a step would do,
    without a step's cost); the new weights. A tied head (the tiny model's is its
    embedding, exported under both names) moves with the embedding."""
    generator = torch.Generator().manual_seed(seed)
    state = {name: torch.as_tensor(t) for name, t in
             ray.get(group.async_export_weights()).items()}
    moved = {name: t + 0.01 * torch.randn(tuple(t.shape), generator=generator)
             for name, t in state.items()}
    head, embedding = "lm_head.weight", "model.embed_tokens.weight"
    if head in state and torch.equal(state[head], state[embedding]):
        moved[head] = moved[embedding]
    group.load_weights(moved)
    return moved


def test_transport_for_picks_one_transport_per_kind() -> None:
    picks = {kind: type(transport_for(kind, None, None, "float32", 1.0, lambda r, v: r))
             for kind in ("object_store", "disk", "nccl", "cuda_ipc", "in_process")}
    assert picks == {"object_store": ObjectStoreTransport, "disk": ObjectStoreTransport,
                     "nccl": NcclTransport, "cuda_ipc": CudaIpcTransport,
                     "in_process": InProcessTransport}
    with pytest.raises(ValueError, match="unknown transport 'pigeon'"):
        transport_for("pigeon", None, None, "float32", 1.0, lambda r, v: r)


@pytest.mark.slow  # two trainer ranks and an engine actor
def test_the_object_store_delivers_version_v_exactly_and_refuses_another(
        ray_cluster: None, tiny_model: str) -> None:
    group = TrainerGroup(TrainerConfig(dp_size=2), ObjectiveConfig(), tiny_model,
                         total_steps=1)
    engine = ray.remote(num_cpus=0)(ReadableEngine).remote(ENGINE, tiny_model)
    try:
        trained = _perturbed(group, seed=1)
        transport = ObjectStoreTransport(group, engine, "float32", bucket_mb=0.01)
        load, metrics = transport.send_weights(3)
        ray.get(load)
        assert ray.get(engine.ping.remote()) == 3
        served = ray.get(engine.weights.remote())
        for name, tensor in trained.items():  # fp32 on both sides: bit for bit
            assert np.array_equal(served[name], tensor.numpy()), name
        sent = [t for name, t in trained.items() if name != "lm_head.weight"]  # tied: once
        assert metrics["perf/sync_bytes"] == sum(t.numel() * 4 for t in sent)

        _perturbed(group, seed=2)
        sender = ObjectStoreSender("float32", 0.01)
        shipment, _ = group.send_weights(ObjectStoreSender.send, sender, 4)[0]
        assert len(shipment.buckets) > 1
        with pytest.raises(WeightVersionMismatch, match="asked to load weights 5"):
            ray.get(engine.receive_weights.remote(5, shipment))
        assert ray.get(engine.ping.remote()) == 3  # still the old version, untouched
        served_after = ray.get(engine.weights.remote())
        assert all(np.array_equal(served_after[n], served[n]) for n in served)
    finally:
        ray.kill(engine)
        group.shutdown()


def _decoded(model_path: str, state: dict[str, torch.Tensor]) -> list:
    engine = TorchEngine(ENGINE, model_path)
    missing, unexpected = engine.model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in name for name in missing)
    return engine.generate(PROMPTS, SAMPLING, 3)


@pytest.mark.slow  # a colocated rank: trainer and engine in one actor
def test_in_process_serves_version_v_as_staged_and_refuses_one_never_staged(
        ray_cluster: None, tiny_model: str) -> None:
    from services.driver.colocated import ColocatedTrainerGroup

    group = ColocatedTrainerGroup(TrainerConfig(dp_size=1), ObjectiveConfig(), tiny_model,
                                  total_steps=1)
    try:
        (engine,) = group.start_engines(ENGINE, None, 1, synchronous=False)  # copy mode
        trained = _perturbed(group, seed=1)
        load, metrics = InProcessTransport(group, engine).send_weights(1)
        assert ray.get(load) == 1 and ray.get(engine.ping.remote()) == 1
        assert metrics["perf/sync_bytes"] > 0  # copied into a buffer set
        served = ray.get(engine.generate.remote(PROMPTS, SAMPLING, 3))
        assert served == _decoded(tiny_model, trained)

        with pytest.raises(KeyError, match="weights 2 were never staged"):
            ray.get(engine.receive_weights.remote(2))
        assert ray.get(engine.ping.remote()) == 1
        assert ray.get(engine.generate.remote(PROMPTS, SAMPLING, 3)) == served
    finally:
        group.shutdown()
