"""What each GPU test needs, as a skip mark (checked before any fixture starts).

``TALLY_GPU_CHECKS_ON=cpu`` runs the one-GPU checks on the CPU instead (gloo, smaller
sizes): how tests/gpu/run.sh is shown to work, without Ray, in an environment holding
only the GPU machine's packages and the carried wheels."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ON_CPU = os.environ.get("TALLY_GPU_CHECKS_ON") == "cpu"
DEVICE = "cpu" if ON_CPU or not torch.cuda.is_available() else "cuda"
"""Where the one-GPU checks run."""


def needs(num_gpus: int = 1, packages: tuple[str, ...] = ()) -> pytest.MarkDecorator:
    """Skip unless ``num_gpus`` CUDA devices (one: or the CPU stand-in) and every package
    are present."""
    missing = [p for p in packages if importlib.util.find_spec(p.split(".")[0]) is None
               or importlib.util.find_spec(p) is None]
    num_found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ON_CPU and num_gpus == 1:
        num_found = 1
    reason = (f"needs {num_gpus} CUDA GPU(s), found {num_found}" if num_found < num_gpus
              else f"needs {', '.join(missing)}")
    return pytest.mark.skipif(num_found < num_gpus or bool(missing), reason=reason)
