"""What each GPU test needs, as a skip mark (checked before any fixture starts)."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def needs(num_gpus: int = 1, packages: tuple[str, ...] = ()) -> pytest.MarkDecorator:
    """Skip unless ``num_gpus`` CUDA devices and every package are present."""
    missing = [p for p in packages if importlib.util.find_spec(p.split(".")[0]) is None
               or importlib.util.find_spec(p) is None]
    num_found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    reason = (f"needs {num_gpus} CUDA GPU(s), found {num_found}" if num_found < num_gpus
              else f"needs {', '.join(missing)}")
    return pytest.mark.skipif(num_found < num_gpus or bool(missing), reason=reason)
