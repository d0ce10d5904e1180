"""A session's rank (services/sessions/calls.py) on a real gloo process group, no Ray:
a committed call's gradient joins the accumulated one, a failed call is restored to
exactly the gradient before it, ``forward_only`` reports the sums without touching a
gradient, and ``apply_gradients`` steps on the scaled sum and clears it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.trainer.helpers import sampled_train_batch
from trainer.config import ObjectiveConfig, TrainerConfig

ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _grads(worker: Any) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in worker.trained]


def _session(rank: int, port: int, model_path: str, batch: Any) -> dict[str, Any]:
    from services.sessions.calls import InjectedFault, SessionRank
    from trainer.step_plan import plan_step

    worker = SessionRank(TrainerConfig(), ObjectiveConfig(), model_path, rank, total_steps=1)
    worker.setup("127.0.0.1", port)
    plan = plan_step(batch, ObjectiveConfig(), 1, 1, max_tokens_per_micro_batch=64)
    out: dict[str, Any] = {"only": worker.forward_only(batch, plan),
                           "untouched": all(p.grad is None for p in worker.trained)}
    out["sums"] = worker.forward_backward_call(batch, plan)
    worker.commit_call()
    once = _grads(worker)
    worker.arm_fault("forward_backward")
    try:
        worker.forward_backward_call(batch, plan)
    except InjectedFault:
        out["fault"] = True
    worker.restore_call()
    out["restored"] = all(torch.equal(a, b) for a, b in zip(_grads(worker), once, strict=True))
    worker.forward_backward_call(batch, plan)
    worker.commit_call()
    out["summed"] = all(torch.equal(a, 2 * b) for a, b in zip(_grads(worker), once, strict=True))
    out["norm_once"] = float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in once])))
    before = [p.detach().clone() for p in worker.trained]
    out["step"] = worker.apply_gradients(0.5, ADAM, None)  # the mean of the two calls
    out["cleared"] = all(p.grad is None for p in worker.trained)
    out["moved"] = any(not torch.equal(p, b) for p, b in zip(worker.trained, before,
                                                             strict=True))
    return out


@pytest.mark.slow  # one FSDP rank on the tiny model
def test_a_session_rank_accumulates_restores_and_steps(tiny_model: str) -> None:
    batch = sampled_train_batch(tiny_model, temperature=1.0)
    out, = run_ranks(_session, 1, tiny_model, batch)
    assert out["untouched"] and out["only"] == pytest.approx(out["sums"], rel=1e-6)
    assert out["fault"] and out["restored"] and out["summed"]
    assert out["step"]["grad_norm"] == pytest.approx(out["norm_once"], rel=1e-5)
    assert out["step"]["lr"] == ADAM["lr"] and out["cleared"] and out["moved"]
