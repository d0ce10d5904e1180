"""The FSDP attention kernel of packed rows: varlen flash attention only on CUDA, in
fp16/bf16, with flash-attention 2 as transformers sees it; SDPA's mask in every other
case. The decision is pure, so every case is checked here on CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from trainer.backends.fsdp import model as fsdp
from trainer.backends.fsdp.model import attention_choice, use_varlen_flash_attention
from trainer.config import TrainerConfig

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.mark.parametrize("available", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_flash_only_with_flash_attn_2_half_precision_on_cuda(
        available: bool, dtype: torch.dtype, device_type: str) -> None:
    choice = attention_choice(available, dtype, device_type)
    flash = available and dtype in (torch.float16, torch.bfloat16) and device_type == "cuda"
    assert choice.implementation == ("flash_attention_2" if flash else "sdpa")
    assert choice.reason


def test_reasons_name_what_is_missing() -> None:
    assert "cpu" in attention_choice(True, torch.bfloat16, "cpu").reason
    assert "fp16/bf16" in attention_choice(True, torch.float32, "cuda").reason
    assert "flash-attention 2" in attention_choice(False, torch.bfloat16, "cuda").reason


class _Model(torch.nn.Module):
    """Stands in for a PreTrainedModel: records the implementation it is switched to."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.switched_to: str | None = None

    def set_attn_implementation(self, implementation: str) -> None:
        self.switched_to = implementation


@pytest.fixture
def fake_flash_attn_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers says flash-attention 2 is there and the model sits on CUDA (the
    decision sees only the device type; nothing runs)."""
    import transformers.utils

    fsdp._log_choice.cache_clear()  # each test sees its own log line
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    monkeypatch.setattr(fsdp, "attention_choice",
                        lambda available, dtype, _device: attention_choice(
                            available, dtype, "cuda"))


def test_switches_on_flash_where_the_choice_allows(fake_flash_attn_2: None,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    model = _Model()
    with caplog.at_level(logging.INFO, logger="tally.trainer"):
        assert use_varlen_flash_attention(model, TrainerConfig(shared_prefix=False),
                                          torch.bfloat16)
    assert model.switched_to == "flash_attention_2"
    assert any(getattr(r, "attention_implementation", None) == "flash_attention_2"
               for r in caplog.records if r.name == "tally.trainer")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_keeps_sdpa(fake_flash_attn_2: None, dtype: torch.dtype) -> None:
    model = _Model()
    assert not use_varlen_flash_attention(model, TrainerConfig(shared_prefix=False), dtype)
    assert model.switched_to is None


@pytest.mark.parametrize("config", [TrainerConfig(packing=False), TrainerConfig(cp_size=2),
                                    TrainerConfig()])  # the default shares prefixes
def test_unpacked_cp_or_shared_prefix_keeps_sdpa(fake_flash_attn_2: None,
                                                 config: TrainerConfig) -> None:
    model = _Model()
    assert not use_varlen_flash_attention(model, config, torch.bfloat16)
    assert model.switched_to is None


def test_namespace_flash_attn_is_not_flash_attn_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``flash_attn`` module that imports (flash-attn-4 alone provides one) does not
    switch flash attention on: transformers' own check decides."""
    import sys
    import types

    import transformers.utils

    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    monkeypatch.setattr(fsdp, "attention_choice",
                        lambda available, dtype, _device: attention_choice(
                            available, dtype, "cuda"))
    model = _Model()
    assert not use_varlen_flash_attention(model, TrainerConfig(), torch.bfloat16)
    assert model.switched_to is None


def test_on_cpu_the_default_dtype_keeps_sdpa() -> None:
    """No dtype given: ``trainer.dtype`` on the model's device (fp32 on CPU)."""
    model = _Model()
    assert not use_varlen_flash_attention(model, TrainerConfig())
    assert model.switched_to is None
