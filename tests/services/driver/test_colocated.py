"""The colocated rank composed in services (services/driver/colocated.py) on real gloo
process groups, no Ray: two FSDP ranks, rank 0 an engine, rank 1 only in the gathers.
Version 0 decodes what an engine loaded from the folder decodes; after a training step,
staged and served, version 1 decodes what an engine loaded from the trained weights
decodes, in place (synchronous) and in a reused copy (the async pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.trainer.helpers import sampled_train_batch
from trainer.config import ObjectiveConfig, OptimizerConfig, TrainerConfig

PROMPTS = [[1, 70, 84, 4, 69, 70, 33], [1, 86, 73, 90, 4, 69, 33], [1, 69, 33]]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8)
ENGINE = TorchEngineConfig(batch_size=4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _colocated(rank: int, port: int, model_path: str, batch: Any, synchronous: bool
               ) -> dict[str, Any]:
    from services.driver.colocated import ColocatedRank
    from services.driver.transports.in_process import InProcessSender
    from trainer.step_plan import plan_step
    from trainer.transports.base import WeightSource

    config = TrainerConfig(dp_size=2, optimizer=OptimizerConfig(lr=5e-2, grad_clip=None))
    worker = ColocatedRank(config, ObjectiveConfig(), model_path, rank, total_steps=1)
    worker.setup("127.0.0.1", port)
    assert isinstance(worker, WeightSource)
    worker.start_engine(ENGINE, None, 0 if rank == 0 else None, synchronous)
    out: dict[str, Any] = {"ping": worker.ping()}
    if rank == 0:
        out["before"] = worker.generate(PROMPTS, SAMPLING, 3)
    worker.train_step(batch, plan_step(batch, ObjectiveConfig(), 2, 1,
                                       max_tokens_per_micro_batch=64))
    _, out["stage"] = worker.send_weights(InProcessSender.send, InProcessSender(), 1)
    out["trained"] = worker.export_weights()
    if rank == 0:
        out["served"] = worker.receive_weights(1)
        out["ping"] = worker.ping()
        out["after"] = worker.generate(PROMPTS, SAMPLING, 3)
        out["mode"] = worker.host.engine.mode
    return out


def _decoded(model_path: str, state: dict[str, torch.Tensor] | None = None) -> list:
    from rollout.engines.torch_engine import TorchEngine

    engine = TorchEngine(ENGINE, model_path)
    if state is not None:
        missing, unexpected = engine.model.load_state_dict(state, strict=False)
        assert not unexpected and all("lm_head" in name for name in missing)
    return engine.generate(PROMPTS, SAMPLING, 3)


@pytest.mark.slow  # two FSDP ranks with an engine on rank 0
@pytest.mark.parametrize(("synchronous", "mode"), [(True, "in_place"), (False, "copy")])
def test_a_colocated_rank_serves_the_version_it_staged(tiny_model: str, tmp_path: Path,
                                                        synchronous: bool, mode: str) -> None:
    batch = sampled_train_batch(tiny_model, temperature=1.0)
    engine_rank, gather_only = run_ranks(_colocated, 2, tiny_model, batch, synchronous)
    assert engine_rank["mode"] == mode
    assert engine_rank["before"] == _decoded(tiny_model)
    assert engine_rank["served"] == 1 and engine_rank["ping"] == 1
    assert gather_only["ping"] == -1 and gather_only["trained"] is None  # no engine there
    assert engine_rank["stage"]["perf/sync_bytes"] > 0 == gather_only["stage"][
        "perf/sync_bytes"]
    want = _decoded(tiny_model, engine_rank["trained"])
    assert want != engine_rank["before"]  # the step moved what is sampled
    assert engine_rank["after"] == want
