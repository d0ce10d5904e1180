"""Checks a job needs before anything starts that pydantic cannot see: optional packages
and local paths. Free of torch and Ray, so the controller runs them at submit time and the
driver again at start."""

from __future__ import annotations

from pathlib import Path

from rollout.datasets import DatasetError, check_dataset_available
from rollout.engines import check_engine_available
from rollout.pretrained import SMOLLM2_NAME, ModelImportError, require_gguf, smollm2_gguf_path
from services.config import ConfigError, ConfigProblem, JobConfig
from services.driver.wandb_sink import check_wandb_available


def preflight(config: JobConfig) -> None:
    """Raises ConfigError naming the field (source "": the config is already parsed)."""
    try:
        check_engine_available(config.rollout)
    except RuntimeError as err:
        raise ConfigError("", [ConfigProblem.from_rule(str(err), "rollout")]) from None
    try:
        check_dataset_available(config.rollout.dataset)
    except DatasetError as err:
        raise ConfigError("", [ConfigProblem.from_rule(str(err), "rollout")]) from None
    if config.rollout.model == SMOLLM2_NAME:
        try:
            smollm2_gguf_path()  # imported into the data folder at start, once
            require_gguf()
        except ModelImportError as err:
            raise ConfigError("", [ConfigProblem.from_rule(str(err), "rollout")]) from None
    check_wandb_available(config.logging.wandb)
    local_model = config.rollout.model not in ("tiny", SMOLLM2_NAME)
    if local_model and not Path(config.rollout.model).is_dir():
        raise ConfigError("", [ConfigProblem(
            "rollout.model", f"{config.rollout.model} is not a local directory")])
    if config.trainer.backend == "megatron":
        from trainer.backends.megatron import check_available

        try:
            check_available(config.trainer, config.rollout.model if local_model else None)
        except ValueError as err:
            raise ConfigError("", [ConfigProblem.from_rule(str(err))]) from None
