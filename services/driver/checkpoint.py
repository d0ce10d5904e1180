"""The driver's part of a checkpoint, as data: never a pickle.

    checkpoints/step_N/
        model/, trainer_state.pt           the trainer's part (trainer/checkpoint.py)
        driver_state.json                  {"step": N, "rollout": manager state}
        rollouts_in_flight.safetensors     async only: the rollouts generated for the steps
                                           after N, each RolloutBatch's tensors under
                                           "<step>/<field>", its scalars in the header

A checkpoint folder is staged and committed by trainer/checkpoint.py (written aside,
renamed when complete). Loading reads JSON and safetensors only, so a checkpoint from
anywhere cannot run code; :func:`unreadable` checks every file before a resume uses it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollout.batch import RolloutBatch
from services.config import JobConfig
from services.driver.run_dir import RunDir
from services.driver.sinks import truncate_after
from trainer import checkpoint as trainer_checkpoint

DRIVER_STATE = "driver_state.json"
ROLLOUTS_IN_FLIGHT = "rollouts_in_flight.safetensors"
SCALAR_FIELDS = ("samples_per_prompt", "pad_token_id", "metadata")
"""RolloutBatch fields that are not tensors: kept in the safetensors header as JSON."""


@dataclass(frozen=True)
class DriverState:
    step: int
    """The last rollout step the checkpoint holds (the resume starts at step + 1)."""
    rollout: dict[str, Any]
    """RolloutManager.state_dict(): data cursor, next group index, weight version, seed."""
    in_flight: dict[int, RolloutBatch]
    """Async: rollouts already generated for the steps after ``step``."""


def due(step: int, config: JobConfig) -> bool:
    """Rollout step ``step`` ends with a checkpoint: every ``checkpoint_every`` and the last."""
    return step == config.num_steps - 1 or bool(
        config.checkpoint_every and (step + 1) % config.checkpoint_every == 0)


def newest_readable(run_dir: RunDir, log: Callable[[str], None]) -> Path | None:
    """The newest committed checkpoint every file of which reads; each unreadable one
    newer than it is reported (an event and a log line) and passed over."""
    for folder in trainer_checkpoint.checkpoints(run_dir.checkpoints_dir):
        reason = unreadable(folder)
        if reason is None:
            return folder
        run_dir.write_event("checkpoint_unreadable", f"{folder.name}: {reason}; trying "
                            "the one before")
        log(f"checkpoint {folder.name} is unreadable ({reason})")
    return None


def truncate_rows_after(run_dir: RunDir, step: int, num_updates_per_rollout: int) -> None:
    """Drop the rows a resume from rollout step ``step`` repeats: rollout steps after it,
    their optimizer steps, the evaluations of the weights after it."""
    truncate_after(run_dir.metrics_file, step)
    truncate_after(run_dir.updates_file, (step + 1) * num_updates_per_rollout - 1)
    truncate_after(run_dir.eval_file, step)


def save_driver_state(folder: Path, state: DriverState) -> None:
    (folder / DRIVER_STATE).write_text(json.dumps({"step": state.step,
                                                   "rollout": state.rollout}))
    if state.in_flight:
        tensors, header = _rollouts_as_data(state.in_flight)
        save_file(tensors, str(folder / ROLLOUTS_IN_FLIGHT),
                  metadata={"rollouts": json.dumps(header)})


def load_driver_state(folder: Path) -> DriverState:
    saved = json.loads((folder / DRIVER_STATE).read_text())
    in_flight = (_read_rollouts(folder / ROLLOUTS_IN_FLIGHT)
                 if (folder / ROLLOUTS_IN_FLIGHT).exists() else {})
    return DriverState(int(saved["step"]), saved["rollout"], in_flight)


def unreadable(folder: str | Path) -> str | None:
    """Why a committed checkpoint cannot be resumed from, or None: every driver file is
    read (a pickle where the rollouts belong is refused), the trainer's headers too."""
    folder = Path(folder)
    try:
        load_driver_state(folder)
    except Exception as err:  # any failure to read is the answer
        return f"{type(err).__name__}: {str(err).strip()[:300]}"
    return trainer_checkpoint.unreadable(folder)


def _rollouts_as_data(batches: dict[int, RolloutBatch]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    tensors, header = {}, {}
    for step, batch in batches.items():
        header[str(step)] = {name: getattr(batch, name) for name in SCALAR_FIELDS}
        for name in _tensor_fields():
            value = getattr(batch, name)
            if value is not None:
                tensors[f"{step}/{name}"] = value.contiguous()
    return tensors, header


def _read_rollouts(path: Path) -> dict[int, RolloutBatch]:
    try:
        with safe_open(str(path), framework="pt") as stored:
            header = json.loads((stored.metadata() or {})["rollouts"])
            values = {key: stored.get_tensor(key) for key in stored.keys()}  # noqa: SIM118
    except Exception as err:
        raise ValueError(f"{path.name}: not a Tally rollouts file ({type(err).__name__}: "
                         f"{str(err).strip()[:200]}); a checkpoint is data (safetensors + "
                         "JSON), never a pickle") from None
    return {int(step): RolloutBatch(
        **scalars, **{name: values.get(f"{step}/{name}") for name in _tensor_fields()})
        for step, scalars in header.items()}


def _tensor_fields() -> list[str]:
    return [f.name for f in fields(RolloutBatch) if f.init and f.name not in SCALAR_FIELDS]
