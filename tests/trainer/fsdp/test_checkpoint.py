"""Sharded checkpoints on real gloo process groups (no Ray): every rank writes its own
shards, a resume at another DP size reshards them and trains on exactly as the run that
was never interrupted, and a damaged shard is named before any rank loads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.trainer.helpers import sampled_train_batch
from trainer.checkpoint import MANIFEST, SHARDS_DIR
from trainer.checkpoint_check import unreadable
from trainer.config import (
    AggregationConfig,
    LossConfig,
    ObjectiveConfig,
    OptimizerConfig,
    TrainerConfig,
)
from trainer.export import export_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _worker(rank: int, port: int, model_path: str, dp: int):
    from trainer.backends.fsdp.worker import FSDPWorker

    config = TrainerConfig(dp_size=dp, loss=LossConfig(old_log_probs="rollout"),
                           optimizer=OptimizerConfig(lr=1e-3))
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 10, 1.0)
    worker = FSDPWorker(config, objective, model_path, rank, total_steps=3)
    worker.setup("127.0.0.1", port)
    return worker, objective


def _step(worker, objective, batch) -> dict[str, float]:
    from trainer.step_plan import plan_step

    plan = plan_step(batch, objective, worker.config.dp_size, 1,
                     max_tokens_per_micro_batch=64, packed=True)
    return worker.train_step(batch, plan)


def _train_and_save(rank: int, port: int, model_path: str, dp: int, batch, path: str):
    """Two steps, a checkpoint, a third step: the uninterrupted run (and its weights at the
    checkpoint, for the export test: one run serves both)."""
    worker, objective = _worker(rank, port, model_path, dp)
    for _ in range(2):
        _step(worker, objective, batch)
    worker.save_checkpoint(path)
    at_save = worker.export_weights()
    metrics = _step(worker, objective, batch)
    return metrics, worker.export_weights(), at_save


def _fresh_step_then_resume(rank: int, port: int, model_path: str, dp: int, batch,
                            path: str):
    """The control first (one step from a fresh start), then the checkpoint loaded over
    that trained state and one step: one process group for both (each spawn imports torch
    and transformers anew). Loading over a worker that has already stepped also shows the
    load replaces weights, AdamW state, schedule and RNG rather than filling a fresh
    worker."""
    worker, objective = _worker(rank, port, model_path, dp)
    _step(worker, objective, batch)
    fresh_weights = worker.export_weights()
    worker.load_checkpoint(path)
    metrics = _step(worker, objective, batch)
    return metrics, worker.export_weights(), fresh_weights


@pytest.fixture(scope="module")
def batch(tiny_model: str):
    return sampled_train_batch(tiny_model, temperature=1.0)


@pytest.fixture(scope="module")
def saved(tiny_model: str, batch, tmp_path_factory: pytest.TempPathFactory):
    """DP size -> (its checkpoint's folder, the uninterrupted run's rank-0 result): each
    run once per module, shared by the resume tests and the export test."""
    runs: dict[int, tuple[Path, tuple]] = {}

    def run(dp: int) -> tuple[Path, tuple]:
        if dp not in runs:
            path = tmp_path_factory.mktemp(f"saved_dp{dp}") / "step"
            runs[dp] = path, run_ranks(_train_and_save, dp, tiny_model, dp, batch,
                                       str(path))[0]
        return runs[dp]

    return run


@pytest.mark.parametrize(("saved_at", "resumed_at"), [(2, 1), (1, 2)])
def test_a_resume_at_another_dp_size_trains_on_as_the_uninterrupted_run(
        tiny_model: str, batch, saved, saved_at: int, resumed_at: int) -> None:
    path, (metrics, weights, _) = saved(saved_at)
    written = sorted(p.name for p in (path / SHARDS_DIR).glob("*.distcp"))
    assert [name.split("_")[2] for name in written] == [str(r) for r in range(saved_at)]
    resumed, resumed_weights, fresh_weights = run_ranks(
        _fresh_step_then_resume, resumed_at, tiny_model, resumed_at, batch, str(path))[0]
    for name in ("pg_loss", "grad_norm", "lr"):
        assert resumed[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-7), name
    assert resumed_weights.keys() == weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(resumed_weights[name], tensor, rtol=1e-5, atol=1e-6)

    # The control: the checkpoint is what made them equal (a fresh start is far off).
    moved = max(float((fresh_weights[n] - t).abs().max()) for n, t in weights.items())
    assert moved > 1e-4


def test_the_export_loads_with_from_pretrained_and_a_damaged_shard_is_named(
        tiny_model: str, saved, tmp_path: Path) -> None:
    import shutil

    from transformers import AutoModelForCausalLM

    # DP 2's checkpoint after two steps, written by the resume test's run; a copy, since
    # this test damages it.
    source, (_, _, trained) = saved(2)
    path = tmp_path / "step"
    shutil.copytree(source, path)
    assert unreadable(path) is None

    export_checkpoint(path, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert loaded.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name  # fp32: bit for bit
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert any(not torch.equal(initial[n], t) for n, t in trained.items())  # it trained
    export_checkpoint(path, tmp_path / "bf16", dtype="bfloat16", max_shard_bytes=20_000)
    shards = sorted(p.name for p in (tmp_path / "bf16").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert half.dtype == torch.bfloat16
    for name, tensor in half.state_dict().items():
        assert torch.equal(tensor, trained[name].to(torch.bfloat16)), name

    shard = path / SHARDS_DIR / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, different content
    shard.write_bytes(bytes(data))
    assert unreadable(path).startswith("ValueError: __1_0.distcp: ")
    shard.unlink()
    assert unreadable(path) == "FileNotFoundError: __1_0.distcp: missing"
    (path / SHARDS_DIR / MANIFEST).unlink()
    assert "manifest.json" in unreadable(path)
