"""Inference engines, keyed by ``engine.type``: ``torch`` (in-process HF model) and
``sglang`` (SGLang servers over HTTP).

This module imports neither torch nor sglang, so the controller can call
:func:`check_engine_available` at submit time; :func:`engine_class` imports the chosen
engine only when an engine is actually built.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rollout.config import EngineConfig, RolloutConfig, SGLangEngineConfig, TorchEngineConfig
from rollout.plugins import load_object

_ENGINE_CLASSES = {
    "torch": "rollout.engines.torch_engine:TorchEngine",
    "sglang": "rollout.engines.sglang_engine:SGLangEngine",
}


class EngineUnavailableError(RuntimeError):
    """The chosen engine cannot run in this environment."""


def check_engine_available(config: RolloutConfig | EngineConfig) -> None:
    """Raise EngineUnavailableError when the chosen engine cannot run here.

    Launching SGLang servers needs the ``sglang`` package; connecting to running servers
    (``engine.urls``) only speaks HTTP and does not.
    """
    engine = config.engine if isinstance(config, RolloutConfig) else config
    launches_sglang = isinstance(engine, SGLangEngineConfig) and engine.urls is None
    if launches_sglang and importlib.util.find_spec("sglang") is None:
        raise EngineUnavailableError(
            "engine.type: 'sglang' launches SGLang servers, but the sglang package is not "
            "installed here (pip install 'tally[sglang]' on a GPU machine); use "
            "engine.type: torch, or engine.urls to connect to running servers"
        )
    if isinstance(engine, TorchEngineConfig) and importlib.util.find_spec("torch") is None:
        raise EngineUnavailableError("engine.type: 'torch' needs the torch package")


def engine_class(config: EngineConfig) -> type:
    """The Engine subclass of ``config.type`` (imported on demand)."""
    return load_object(_ENGINE_CLASSES[config.type], "engine.type")


def engine_actor_options(config: EngineConfig) -> dict[str, Any]:
    """Ray resources of one engine actor."""
    if isinstance(config, SGLangEngineConfig):
        return {"num_cpus": 0, "num_gpus": config.actor_num_gpus}  # the server does the work
    return {"num_cpus": config.num_cpus, "num_gpus": config.num_gpus,
            "resources": dict(config.resources)}


__all__ = [
    "EngineUnavailableError",
    "check_engine_available",
    "engine_actor_options",
    "engine_class",
]
