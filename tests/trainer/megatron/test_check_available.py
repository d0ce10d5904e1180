"""The Megatron preflight names the field and the fix before any actor starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rollout.tiny import create_tiny_checkpoint
from trainer.backends.megatron import check_available
from trainer.config import TrainerConfig

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
