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


def _train_save_resume(rank: int, port: int, model_path: str, dp: int, batch, path: str,
                       resume_from: str | None = None) -> dict[str, object]:
    """The uninterrupted run: a step (its weights: the fresh start's, the resume tests'
    control), a second, a checkpoint (the weights then: the export test's), a third.
    With ``resume_from``, another DP size's checkpoint then loaded over this trained
    state and one step (the resumed run: in the same process group, as each spawn imports
    torch and transformers anew; loading over a worker that has stepped also shows the
    load replaces weights, AdamW state, schedule and RNG rather than filling a fresh
    one)."""
    worker, objective = _worker(rank, port, model_path, dp)
    _step(worker, objective, batch)
    fresh = worker.export_weights()
    _step(worker, objective, batch)
    worker.save_checkpoint(path)
    at_save = worker.export_weights()
    out = {"fresh": fresh, "at_save": at_save, "metrics": _step(worker, objective, batch),
           "weights": worker.export_weights()}
    if resume_from:
        worker.load_checkpoint(resume_from)
        out["resumed"] = (_step(worker, objective, batch), worker.export_weights())
    return out


def _resume(rank: int, port: int, model_path: str, dp: int, batch, path: str):
    worker, objective = _worker(rank, port, model_path, dp)
    worker.load_checkpoint(path)
    return _step(worker, objective, batch), worker.export_weights()


@pytest.fixture(scope="module")
def runs(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Three spawns for the module: DP 1's uninterrupted run; DP 2's, then DP 1's
    checkpoint resumed over it; DP 1 resumed from DP 2's checkpoint."""
    batch = sampled_train_batch(tiny_model, temperature=1.0)
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {dp: root / f"dp{dp}" / "step" for dp in (1, 2)}
    dp1 = run_ranks(_train_save_resume, 1, tiny_model, 1, batch, str(paths[1]))[0]
    dp2 = run_ranks(_train_save_resume, 2, tiny_model, 2, batch, str(paths[2]),
                    str(paths[1]))[0]
    resumed_at_1 = run_ranks(_resume, 1, tiny_model, 1, batch, str(paths[2]))[0]
    return {"paths": paths, "uninterrupted": {1: dp1, 2: dp2},
            "resumed": {1: resumed_at_1, 2: dp2["resumed"]}}


@pytest.mark.parametrize(("saved_at", "resumed_at"), [(2, 1), (1, 2)])
def test_a_resume_at_another_dp_size_trains_on_as_the_uninterrupted_run(
        runs: dict[str, object], saved_at: int, resumed_at: int) -> None:
    path = runs["paths"][saved_at]
    uninterrupted = runs["uninterrupted"][saved_at]
    metrics, weights = uninterrupted["metrics"], uninterrupted["weights"]
    written = sorted(p.name for p in (path / SHARDS_DIR).glob("*.distcp"))
    assert [name.split("_")[2] for name in written] == [str(r) for r in range(saved_at)]
    resumed, resumed_weights = runs["resumed"][resumed_at]
    for name in ("pg_loss", "grad_norm", "lr"):
        assert resumed[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-7), name
    assert resumed_weights.keys() == weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(resumed_weights[name], tensor, rtol=1e-5, atol=1e-6)

    # The control: the checkpoint is what made them equal (a fresh start is far off):
    # one step from a fresh start at the resumed DP size.
    fresh_weights = runs["uninterrupted"][resumed_at]["fresh"]
    moved = max(float((fresh_weights[n] - t).abs().max()) for n, t in weights.items())
    assert moved > 1e-4


def test_the_export_loads_with_from_pretrained_and_a_damaged_shard_is_named(
        runs: dict[str, object], tiny_model: str, tmp_path: Path) -> None:
    import shutil

    from transformers import AutoModelForCausalLM

    # DP 2's checkpoint after two steps (the resume tests' run); a copy, since this test
    # damages it.
    trained = runs["uninterrupted"][2]["at_save"]
    path = tmp_path / "step"
    shutil.copytree(runs["paths"][2], path)
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
