"""The old-log-prob pass runs the policy in eval mode: on a tiny model with attention
dropout, two passes agree and equal the engine's log-probs (π_old is π itself), while
the loss's forward (train mode) still drops; train mode is back after the pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.trainer.helpers import sampled_train_batch
from trainer.config import ObjectiveConfig, TrainerConfig


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(create_tiny_checkpoint(tmp_path_factory.mktemp("tiny-dropout"), seed=0))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    return str(path)


def _two_passes(rank: int, port: int, model_path: str, batch) -> dict:
    from trainer.backends.fsdp.worker import FSDPWorker
    from trainer.micro_batch import slice_for_plan
    from trainer.step_plan import plan_step

    config = TrainerConfig(dp_size=1, packing=False)  # the plain HF forward: sdpa drops
    objective = ObjectiveConfig(temperature=1.0)
    worker = FSDPWorker(config, objective, model_path, rank, total_steps=1)
    worker.setup("127.0.0.1", port)
    plan = plan_step(batch, objective, 1, 1, max_tokens_per_micro_batch=4096, packed=False)
    worker.model.train()
    first, second = worker.log_probs(batch, plan), worker.log_probs(batch, plan)
    micro = slice_for_plan(batch, plan, plan.micro_batches[0][0], 1, 0)
    keep = micro.loss_mask > 0
    with torch.no_grad():  # the loss's forward, in train mode: dropout on
        trained = [worker._logits(worker.model, micro, keep) for _ in range(2)]
    return {"first": first, "second": second, "training": worker.model.training,
            "train_mode_differs": not torch.equal(*trained)}


@pytest.mark.slow  # one FSDP rank on the tiny model
def test_old_log_probs_are_computed_with_dropout_off(dropout_model: str) -> None:
    batch = sampled_train_batch(dropout_model, temperature=1.0)
    (out,) = run_ranks(_two_passes, 1, dropout_model, batch)
    assert out["train_mode_differs"]  # the config's dropout is live in train mode
    assert torch.equal(out["first"], out["second"])
    mask = batch.loss_mask > 0
    assert torch.allclose(out["first"][mask], batch.rollout_log_probs[mask], atol=1e-5,
                          rtol=0)  # the engine's (eval-mode) log-probs
    assert out["training"]  # restored for the next forward_backward
