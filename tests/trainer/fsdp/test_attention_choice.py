"""The FSDP attention kernel: the whole table of ``attention_choice`` (device, dtype,
packing, shared prefix, CP, flash-attention 2 as transformers sees it), each with a
reason, and ``configure_attention`` switching a model to it and logging it once. The
decision is pure, so every case is checked here on CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from trainer.backends.fsdp import model as fsdp
from trainer.backends.fsdp.model import attention_choice, configure_attention
from trainer.config import TrainerConfig

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def expected(device_type: str, dtype: torch.dtype, packed: bool, shared: bool, cp_size: int,
             flash: bool) -> str:
    """The table, written out independently of the implementation."""
    if not packed and cp_size == 1:
        return "model"
    if cp_size > 1 or device_type != "cuda" or dtype == torch.float64:
        return "sdpa"
    if not shared and flash and dtype in (torch.float16, torch.bfloat16):
        return "flash_attention_2"
    return "flex_attention"


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize(("packed", "shared", "cp_size"),
                         [(True, True, 1), (True, False, 1), (False, False, 1),
                          (True, False, 2), (False, False, 2)])
def test_the_choice_table(flash: bool, dtype: torch.dtype, device_type: str, packed: bool,
                          shared: bool, cp_size: int) -> None:
    choice = attention_choice(device_type=device_type, dtype=dtype, packed=packed,
                              shared_prefix=shared, cp_size=cp_size,
                              flash_attn_2_available=flash)
    assert choice.implementation == expected(device_type, dtype, packed, shared, cp_size,
                                             flash)
    assert choice.reason


def test_reasons_name_what_decided() -> None:
    def reason(**kwargs: object) -> str:
        base = {"device_type": "cuda", "dtype": torch.bfloat16, "flash_attn_2_available": True}
        return attention_choice(**(base | kwargs)).reason

    assert "cpu" in reason(device_type="cpu") and "no backward" in reason(device_type="cpu")
    assert "cp_size 2" in reason(cp_size=2)
    assert "float64" in reason(dtype=torch.float64)
    assert "shared prefix" in reason(shared_prefix=True)
    assert "fp32" in reason(dtype=torch.float32)
    assert "flash-attention 2" in reason(flash_attn_2_available=False)
    assert "padded" in reason(packed=False)


class _Model(torch.nn.Module):
    """Stands in for a PreTrainedModel: records the implementation it is switched to."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.switched_to: str | None = None

    def set_attn_implementation(self, implementation: str) -> None:
        self.switched_to = implementation


@pytest.fixture
def on_cuda_with_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers says flash-attention 2 is there and the model sits on CUDA (the
    decision sees only the device type; nothing runs)."""
    import transformers.utils

    fsdp._log_choice.cache_clear()  # each test sees its own log line
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    real = fsdp.attention_choice
    monkeypatch.setattr(fsdp, "attention_choice",
                        lambda **kw: real(**(kw | {"device_type": "cuda"})))


@pytest.mark.parametrize(("config", "dtype", "switched_to"), [
    (TrainerConfig(shared_prefix=False), torch.bfloat16, "flash_attention_2"),
    (TrainerConfig(), torch.bfloat16, "tally_flex"),  # the default shares prefixes
    (TrainerConfig(shared_prefix=False), torch.float32, "tally_flex"),
    (TrainerConfig(shared_prefix=False), torch.float64, "tally_cp"),
    (TrainerConfig(cp_size=2), torch.bfloat16, "tally_cp"),
    (TrainerConfig(packing=False), torch.bfloat16, None),
])
def test_configure_switches_the_model_and_logs_once(
        on_cuda_with_flash: None, caplog: pytest.LogCaptureFixture, config: TrainerConfig,
        dtype: torch.dtype, switched_to: str | None) -> None:
    models = [_Model(), _Model()]  # the policy and the reference model
    with caplog.at_level(logging.INFO, logger="tally.trainer"):
        choices = {configure_attention(model, config, dtype) for model in models}
    assert [m.switched_to for m in models] == [switched_to] * 2
    (choice,) = choices
    lines = [r for r in caplog.records if r.name == "tally.trainer"
             and getattr(r, "attention_implementation", None) == choice.implementation]
    assert len(lines) == 1 and lines[0].attention_reason == choice.reason


def test_namespace_flash_attn_is_not_flash_attn_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``flash_attn`` module that imports (flash-attn-4 alone provides one) does not
    switch flash attention on: transformers' own check decides."""
    import sys
    import types

    import transformers.utils

    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    real = fsdp.attention_choice
    monkeypatch.setattr(fsdp, "attention_choice",
                        lambda **kw: real(**(kw | {"device_type": "cuda"})))
    model = _Model()
    choice = configure_attention(model, TrainerConfig(shared_prefix=False), torch.bfloat16)
    assert choice.implementation == "flex_attention" and model.switched_to == "tally_flex"


def test_on_cpu_the_default_config_keeps_the_sdpa_pieces() -> None:
    """No dtype given: ``trainer.dtype`` on the model's device (fp32 on CPU)."""
    model = _Model()
    assert configure_attention(model, TrainerConfig()).implementation == "sdpa"
    assert model.switched_to == "tally_cp"
