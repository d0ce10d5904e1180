"""The FSDP2 rank on real gloo process groups (no Ray): log-probs at the sampling
temperature, and fp32 master weights under bf16 compute."""

from __future__ import annotations

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.trainer.helpers import sampled_train_batch, share_bf16_absorbs
from trainer.config import (
    AggregationConfig,
    LossConfig,
    ObjectiveConfig,
    OptimizerConfig,
    TrainerConfig,
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _mismatch(rank: int, port: int, model_path: str, batch, temperatures: list[float],
              world_size: int) -> list[float]:
    from trainer.backends.fsdp.worker import FSDPWorker

    config = TrainerConfig(dp_size=world_size, loss=LossConfig(old_log_probs="rollout"))
    worker = FSDPWorker(config, ObjectiveConfig(), model_path, rank, total_steps=1)
    worker.setup("127.0.0.1", port)
    out = []
    for temperature in temperatures:
        objective = ObjectiveConfig(temperature=temperature)
        worker.objective = objective
        plan = _plan(batch, objective, world_size)
        (sums, _), = worker.gradients(batch, [plan], [objective])
        out.append(sums["mismatch/log_prob_abs_diff"])
    return out


def _plan(batch, objective: ObjectiveConfig, dp_size: int):
    from trainer.step_plan import plan_step

    return plan_step(batch, objective, dp_size, 1, max_tokens_per_micro_batch=64)


@pytest.mark.slow
def test_trainer_log_probs_match_the_engine_at_its_temperature(tiny_model: str) -> None:
    batch = sampled_train_batch(tiny_model, temperature=0.7)
    at_sampling, at_one = run_ranks(_mismatch, 2, tiny_model, batch, [0.7, 1.0], 2)[0]
    assert at_sampling < 1e-5  # mean |log π_trainer − log π_engine| per token
    assert at_one > 1e-2  # a trainer that ignored T would be visibly off


def _train(rank: int, port: int, model_path: str, batch, dtype: str) -> dict[str, float]:
    from trainer.backends.fsdp.worker import FSDPWorker

    config = TrainerConfig(dtype=dtype, optimizer=OptimizerConfig(lr=1e-6, grad_clip=None),
                           loss=LossConfig(old_log_probs="rollout"))
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 10, 1.0)
    worker = FSDPWorker(config, objective, model_path, rank, total_steps=3)
    worker.setup("127.0.0.1", port)
    before = {k: v.clone() for k, v in worker.export_weights().items()}
    dtypes = {str(p.dtype) for p in worker.model.parameters()}
    for _ in range(3):
        worker.train_step(batch, _plan(batch, objective, 1))
    after = worker.export_weights()
    # Rows of characters the batch never uses get no gradient: count the decoder layers.
    layers = [k for k in before if ".layers." in k]
    changed = sum(int((after[k] != before[k]).sum()) for k in layers)
    total = sum(before[k].numel() for k in layers)
    return {"changed": changed / total, "param_dtypes": sorted(dtypes),
            "state_dtype": str(next(iter(worker.optimizer.state.values()))["exp_avg"].dtype)}


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_weights_that_move_at_lr_1e_6(tiny_model: str) -> None:
    batch = sampled_train_batch(tiny_model, temperature=1.0)
    result = run_ranks(_train, 1, tiny_model, batch, "bfloat16")[0]
    assert result["param_dtypes"] == ["torch.float32"]
    assert result["state_dtype"] == "torch.float32"
    assert result["changed"] > 0.5, result

    # The control (why the test can fail): a bf16 copy absorbs an update of lr 1e-6 in
    # almost every layer weight (half a bf16 ulp of a weight near 0.02 is ~6e-5), so a
    # backend stepping its compute copy would leave them unchanged.
    from safetensors.torch import load_file

    initial = load_file(f"{tiny_model}/model.safetensors")
    layers = {k: v for k, v in initial.items() if ".layers." in k}
    assert share_bf16_absorbs(layers, 1e-6) > 0.9


def _old_log_probs(rank: int, port: int, model_path: str, batch, dp: int, cp: int,
                   packed: bool):
    from trainer.backends.fsdp.worker import FSDPWorker
    from trainer.step_plan import plan_step

    config = TrainerConfig(dp_size=dp, cp_size=cp, max_tokens_per_micro_batch=24,
                           packing=packed)
    objective = ObjectiveConfig(temperature=0.7)
    worker = FSDPWorker(config, objective, model_path, rank, total_steps=1)
    worker.setup("127.0.0.1", port)
    plan = plan_step(batch, objective, dp, cp, max_tokens_per_micro_batch=24, packed=packed)
    assert len(plan.micro_batches[0]) > 1  # several micro-batches (rows) per rank
    return worker.log_probs(batch, plan)


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "cp", "packed"), [(2, 1, True), (1, 2, True), (1, 2, False)])
def test_old_log_probs_are_gathered_back_into_the_batch_layout(tiny_model: str, dp: int,
                                                               cp: int, packed: bool) -> None:
    """A rollout's old log-probs, assembled from DP ranks' micro-batches (packed rows or
    padded) and CP shards, are the engine's at its temperature, aligned with input_ids
    and 0 off the mask."""
    batch = sampled_train_batch(tiny_model, temperature=0.7)
    old = run_ranks(_old_log_probs, 2, tiny_model, batch, dp, cp, packed)[0]
    mask = batch.loss_mask > 0
    assert torch.allclose(old[mask], batch.rollout_log_probs[mask], atol=1e-5, rtol=0)
    assert (old[~mask] == 0).all()
