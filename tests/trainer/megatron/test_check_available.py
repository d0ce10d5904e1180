"""The Megatron preflight names the field and the fix before any actor starts, and the
attention decision (TransformerEngine or the local spec, packed or padded) is made once and
handed to the ranks."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout.tiny import create_tiny_checkpoint
from trainer.backends import megatron
from trainer.backends.megatron import (
    MegatronAttention,
    check_available,
    megatron_attention,
    transformer_engine_available,
)
from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.step_plan import packs

pytest.importorskip("megatron.core")


def test_preflight_accepts_and_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = create_tiny_checkpoint(tmp_path, seed=0)
    check_available(TrainerConfig(backend="megatron", tp_size=2), tiny)
    with pytest.raises(ValueError, match=r"trainer\.backend: megatron cannot train .*tp_size"):
        check_available(TrainerConfig(backend="megatron", tp_size=4), tiny)
    with pytest.raises(ValueError, match=r"trainer\.cp_size: .*TransformerEngine"):
        check_available(TrainerConfig(backend="megatron", cp_size=2))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("megatron")
                        else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"pip install '\.\[megatron\]'"):
        check_available(TrainerConfig(backend="megatron"))


# Attention: decided once (megatron_attention), refused where it cannot run.

GPU = {"backend": "megatron", "num_gpus_per_rank": 1}


def test_cp_without_transformer_engine_names_cp_size() -> None:
    """The real path here: TransformerEngine is not installed."""
    if transformer_engine_available():
        pytest.skip("TransformerEngine is installed here")
    with pytest.raises(ValueError, match=r"^trainer\.cp_size: .*TransformerEngine is not "
                                         r"installed \(transformer-engine\[pytorch\]"):
        check_available(TrainerConfig(**GPU, cp_size=2))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_transformer_engine_in_full_precision_names_dtype(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """TE's attention has no fp32/fp64 backend for CP or THD rows."""
    with pytest.raises(ValueError, match=r"^trainer\.dtype: context parallelism .*bfloat16"):
        megatron_attention(TrainerConfig(**GPU, cp_size=2, dtype=dtype), te_available=True)
    with pytest.raises(ValueError, match=r"^trainer\.dtype: packing: true .*packing: false"):
        megatron_attention(TrainerConfig(**GPU, packing=True, dtype=dtype),
                           te_available=True, packing_explicit=True)
    monkeypatch.setattr(megatron, "transformer_engine_available", lambda: True)
    with pytest.raises(ValueError, match=r"^trainer\.dtype: context parallelism"):
        check_available(TrainerConfig(**GPU, cp_size=2, dtype=dtype))
    with pytest.raises(ValueError, match=r"^trainer\.dtype: packing: true"):
        check_available(TrainerConfig(**GPU, packing=True, dtype=dtype))
    # The default packing pads instead, through the local spec, and says why.
    attention = megatron_attention(TrainerConfig(**GPU, dtype=dtype), te_available=True)
    assert attention == MegatronAttention(False, False, attention.note)
    assert "trainer.packing" in attention.note and dtype in attention.note


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_transformer_engine_in_bf16_packs_and_runs_cp(dtype: str) -> None:
    for config in (TrainerConfig(**GPU, dtype=dtype, cp_size=2),
                   TrainerConfig(**GPU, dtype=dtype, packing=True)):
        assert megatron_attention(config, te_available=True,
                                  packing_explicit=True) == MegatronAttention(True, True)
    assert megatron_attention(TrainerConfig(**GPU, dtype=dtype, packing=False),
                              te_available=True) == MegatronAttention(True, False)


def test_packing_set_without_transformer_engine_names_packing() -> None:
    """Set by the user: refused; the default: padded, with a note (never silently)."""
    for gpus in (1, 0):
        config = TrainerConfig(backend="megatron", num_gpus_per_rank=gpus, packing=True)
        with pytest.raises(ValueError, match=r"^trainer\.packing: .*packing: false"):
            megatron_attention(config, te_available=False, packing_explicit=True)
    if not transformer_engine_available():
        with pytest.raises(ValueError, match=r"^trainer\.packing: .*TransformerEngine"):
            check_available(TrainerConfig(**GPU, packing=True))
        check_available(TrainerConfig(**GPU))  # the default falls back
        check_available(TrainerConfig(**GPU, packing=False))
    attention = megatron_attention(TrainerConfig(**GPU), te_available=False)
    assert not attention.transformer_engine and not attention.packed
    assert "TransformerEngine is not installed" in attention.note


def test_the_plan_packs_by_the_decision_and_says_so_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    megatron._log_once.cache_clear()
    monkeypatch.setattr(megatron, "transformer_engine_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="tally.trainer"):
        assert not packs(TrainerConfig(**GPU))
        assert not packs(TrainerConfig(**GPU))
    said = [r for r in caplog.records if r.name == "tally.trainer"]
    assert [r.levelno for r in said] == [logging.WARNING]
    assert "pads micro-batches" in said[0].getMessage()
    monkeypatch.setattr(megatron, "transformer_engine_available", lambda: True)
    assert packs(TrainerConfig(**GPU))
    assert not packs(TrainerConfig(**GPU, packing=False))


def test_the_worker_takes_the_decision_instead_of_detecting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.backends.megatron import worker as megatron_worker

    def detect() -> bool:
        raise AssertionError("the rank detected TransformerEngine itself")

    monkeypatch.setattr(megatron, "transformer_engine_available", detect)
    built, sliced = {}, []
    monkeypatch.setattr(megatron_worker, "build_gpt_model",
                        lambda *args, **kwargs: built.update(kwargs))
    monkeypatch.setattr(megatron_worker, "slice_packed_row",
                        lambda *args: sliced.append("packed"))
    monkeypatch.setattr(megatron_worker, "slice_micro_batch",
                        lambda *args: sliced.append("padded"))
    config = TrainerConfig(**GPU, cp_size=2)
    for attention in (MegatronAttention(True, True), MegatronAttention(False, False)):
        worker = megatron_worker.MegatronWorker(config, ObjectiveConfig(), "unused", 0, 1,
                                                attention=attention)
        assert worker.attention is attention
        worker.device = SimpleNamespace(type="cuda")  # cpu_bridge: a null context
        worker.hf_config = worker.shape = worker.compute_dtype = None
        worker.cp_rank = 0
        worker._build()
        assert built == {"transformer_engine": attention.transformer_engine}
        worker._slice(None, SimpleNamespace(packed=True), [0])
    assert sliced == ["packed", "padded"]
