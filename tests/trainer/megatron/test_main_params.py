"""bf16 compute keeps fp32 main parameters (gloo processes, no Ray).

At lr 1e-6, AdamW moves every weight by about 1e-6 per step, far below bf16's spacing
near the tiny model's weights (≈1e-4 at 0.02). Three Megatron steps with
``dtype: bfloat16`` must still change most fp32 main params; the control — the share of
those weights whose bf16 copy absorbs a ±lr update (all but the few next to zero) —
shows the test fails if the backend ever steps the compute-dtype copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.trainer.helpers import random_train_batch, share_bf16_absorbs
from tests.trainer.megatron.helpers import objective_for, start_worker
from trainer.config import OptimizerConfig, TrainerConfig
from trainer.step_plan import plan_step

pytest.importorskip("megatron.core")

LR, STEPS = 1e-6, 3
CONFIG = TrainerConfig(backend="megatron", dtype="bfloat16", max_tokens_per_micro_batch=20,
                       optimizer=OptimizerConfig(lr=LR, grad_clip=None))


def _bf16_steps(rank: int, port: int, model_path: str) -> dict:
    """Initial and final exported weights, the first step's gradients and the dtypes."""
    objective = objective_for(CONFIG)
    worker = start_worker(CONFIG, objective, model_path, rank, port)
    batch = random_train_batch(100, num_prompts=3, group_size=2)
    plan = plan_step(batch, objective, 1, 1, CONFIG.max_tokens_per_micro_batch)
    initial = worker.export_weights()
    (_, grads), = worker.gradients(batch, [plan], [objective])
    for _ in range(STEPS):
        worker.train_step(batch, plan)
    states = [s for s in worker.optimizer.state.values()]
    rounded = all(torch.equal(p, worker.main.params[n].to(p.dtype))
                  for n, p in worker.model.named_parameters())
    return {"initial": initial, "final": worker.export_weights(), "grads": grads,
            "model_dtypes": {p.dtype for p in worker.model.parameters()},
            "main_dtypes": {p.dtype for p in worker.params},
            "state_dtypes": {v.dtype for s in states for v in s.values() if v.ndim},
            "model_is_rounded_main": rounded}


def _changed_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    return changed / sum(v.numel() for v in before.values())


@pytest.mark.slow
def test_bf16_compute_steps_fp32_main_params(tmp_path: Path) -> None:
    model_path = create_tiny_checkpoint(tmp_path / "tiny", seed=0)
    (result,) = run_ranks(_bf16_steps, 1, model_path)
    assert result["model_dtypes"] == {torch.bfloat16}
    assert result["main_dtypes"] == {torch.float32}
    assert result["state_dtypes"] == {torch.float32}
    assert result["model_is_rounded_main"]
    initial, final = result["initial"], result["final"]
    assert {v.dtype for v in final.values()} == {torch.float32}  # engines get fp32 too
    main_changed = _changed_fraction(initial, final)
    assert main_changed > 0.9, main_changed
    # The control: only weights within ~5e-4 of zero (where bf16's spacing is below 2·lr)
    # could move if the bf16 copy were stepped.
    trained = {k: v for k, v in initial.items() if k in result["grads"]}
    assert share_bf16_absorbs(trained, LR) > 0.95
