"""The Weights & Biases sink: one W&B run per job, fed the rows of metrics.jsonl.

Optional (the ``wandb`` extra) and off unless ``logging.wandb`` is set. The run's files go
under the job folder, ``<job>/wandb/`` (run_dir.WANDB_DIR); its config is the resolved job
config and its step is the rollout step. ``mode: offline`` writes the run there and sends
nothing anywhere (``wandb sync <job>/wandb/offline-run-*`` uploads it later).
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from services.config.job import ConfigError, ConfigProblem
from services.driver.config import WandbConfig

INSTALL_HINT = "pip install 'tally[wandb]'"


def _import_wandb() -> Any:
    try:
        import wandb  # optional: the `wandb` extra
    except ImportError as err:
        raise ConfigError("", [ConfigProblem(
            "logging.wandb", f"needs the wandb package, which is not installed here "
                             f"({INSTALL_HINT})")]) from err
    return wandb


def check_wandb_available(config: WandbConfig | None) -> None:
    """Raises ConfigError naming ``logging.wandb`` when W&B is asked for but not
    installed (a preflight check: nothing is started)."""
    if (config is not None and config.mode != "disabled"
            and importlib.util.find_spec("wandb") is None):  # found, not imported: fast
        _import_wandb()


class WandbSink:
    """Logs each rollout step's finite metrics to a W&B run (non-finite values are dropped,
    as TensorBoardSink does; metrics.jsonl keeps them as null).

    W&B steps only increase, so a step at or below the last one logged (a restart that
    repeats steps from a checkpoint) is skipped: the run keeps the first copy.
    """

    def __init__(self, config: WandbConfig, output_dir: Path, job_name: str,
                 job_config: dict[str, Any]) -> None:
        wandb = _import_wandb()
        offline = config.mode == "offline"
        if offline:  # wandb-core's error reports are network traffic (read when the
            # process's wandb-core starts, at its first run; an explicit setting wins)
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        settings = wandb.Settings(
            silent=True, console="off",  # no banner, no capture of the driver's output
            # System metrics and machine info probe cloud metadata endpoints: not offline.
            # (x_ settings are wandb's internal ones: requirements/cpu.txt pins the version.)
            x_disable_stats=offline, x_disable_machine_info=offline)
        self.run = wandb.init(
            project=config.project, entity=config.entity, name=config.name or job_name,
            tags=list(config.tags), config=job_config, dir=str(output_dir),
            mode=config.mode, settings=settings, reinit="create_new")
        self.last_step: int | None = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.last_step is not None and step <= self.last_step:
            return
        self.run.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)
        self.last_step = step

    def close(self) -> None:
        self.run.finish()


def wandb_sinks(config: WandbConfig | None, output_dir: Path, job_name: str,
                job_config: dict[str, Any]) -> list[WandbSink]:
    """[] unless ``logging.wandb`` is set (and not ``mode: disabled``), else the job's W&B
    sink; ``output_dir`` is the job folder, ``job_config`` the resolved config
    (``JobConfig.model_dump(mode="json")``). Raises ConfigError naming ``logging.wandb``
    when wandb is not installed."""
    if config is None or config.mode == "disabled":
        return []
    return [WandbSink(config, output_dir, job_name, job_config)]
