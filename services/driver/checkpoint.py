"""The driver's part of a checkpoint, as data (never a pickle), and where a start of a
job resumes from.

    checkpoints/step_N/                    after rollout step N (0-based, 8 digits)
        shards/, trainer_state.pt, …       the trainer's part (trainer/checkpoint.py)
        driver_state.json                  {"step": N, "rollout": manager state}
        rollouts_in_flight.safetensors     async only: the rollouts generated for the steps
                                           after N, each RolloutBatch's tensors under
                                           "<step>/<field>", its scalars in the header
    checkpoints/latest -> step_N           the newest committed one (:func:`link_latest`)

A checkpoint folder is staged and committed by trainer/checkpoint.py (written aside,
renamed when complete). Loading reads JSON and safetensors only, so a checkpoint from
anywhere cannot run code; :func:`unreadable` checks every file before a resume uses it.
A checkpoint that reaches outside its folder (a link in it, a stored path that is
absolute or climbs out, metadata that carries code: trainer/checkpoint.py ``confine``)
is hostile, not damaged: a start refuses it, naming the file and the path, instead of
falling back to an older one.

A start resumes (:func:`plan_resume`, before Ray starts) from the newest readable
checkpoint of the job folder (``resume: true``, ``--resume auto``), from a named one
(``--resume PATH``), or from nothing (``--no-resume``); the checkpoints after the start
are set aside, so that no restart and no ``latest`` link picks them. A job whose
checkpoint holds every step is finished. The settings are compared with the config.json
of the checkpoint's job: what changes the trained stream (batch sizes, G, aggregation,
model, data, loss, seeds) is refused naming the field unless forced; the learning-rate
schedule and ``num_steps`` may change (a ``config_changed`` event); where and how the
job runs (layout, resources, timeouts, evaluation, logging) changes freely.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollout.batch import RolloutBatch
from rollout.confined import read_inside
from rollout.sample_record import SampleRecord
from services.config.job import ConfigError, ConfigProblem, JobConfig
from services.driver.run_dir import CONFIG_FILE, LATEST_LINK, RunDir
from services.driver.sinks import truncate_after
from trainer import checkpoint as trainer_checkpoint
from trainer import checkpoint_check

DRIVER_STATE = "driver_state.json"
ROLLOUTS_IN_FLIGHT = "rollouts_in_flight.safetensors"
SCALAR_FIELDS = ("samples_per_prompt", "pad_token_id", "metadata", "events", "samples")
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


def newest_readable(run_dir: RunDir, log: Callable[[str], None],
                   refuse_hostile: bool = False) -> Path | None:
    """The newest committed checkpoint every file of which reads; each unreadable one
    newer than it is reported (an event and a log line) and passed over. With
    ``refuse_hostile`` (a start) one that reaches outside its folder is a ConfigError
    instead: someone planted it, and resuming from the one before would hide that."""
    for folder in trainer_checkpoint.checkpoints(run_dir.checkpoints_dir):
        if refuse_hostile and (why := checkpoint_check.escapes(folder)):
            raise _refused(folder, why)
        reason = unreadable(folder)
        if reason is None:
            return folder
        run_dir.write_event("checkpoint_unreadable", f"{folder.name}: {reason}; trying "
                            "the one before")
        log(f"checkpoint {folder.name} is unreadable ({reason})")
    return None


def _refused(folder: Path, why: str) -> ConfigError:
    return ConfigError("", [ConfigProblem("", (
        f"--resume: {folder}: {why}; refused: a checkpoint is never read outside its "
        "folder (move it aside, or start with --no-resume)"))])


def link_latest(run_dir: RunDir) -> None:
    """Point checkpoints/latest at the newest committed checkpoint (no link when there is
    none), atomically: a new link made beside it is renamed over the old one."""
    newest = trainer_checkpoint.latest_checkpoint(run_dir.checkpoints_dir)
    if newest is None:
        run_dir.latest_link.unlink(missing_ok=True)
        return
    staging = run_dir.checkpoints_dir / f".{LATEST_LINK}.{os.getpid()}.tmp"
    staging.unlink(missing_ok=True)
    os.symlink(newest.name, staging)
    os.replace(staging, run_dir.latest_link)


def set_aside(run_dir: RunDir, after: int, log: Callable[[str], None]) -> None:
    """Move the committed checkpoints after rollout step ``after`` (-1: all) into a
    ``set-aside-<time>`` folder of checkpoints/, where no resume looks, and say so."""
    later = [folder for folder in trainer_checkpoint.checkpoints(run_dir.checkpoints_dir)
             if trainer_checkpoint.checkpoint_step(folder) > after]
    if not later:
        return
    target = run_dir.set_aside_dir()
    target.mkdir()
    for folder in later:
        os.replace(folder, target / folder.name)
    link_latest(run_dir)
    message = (f"{len(later)} checkpoint(s) after step {after} moved to {target}: this "
               "start does not continue them" if after >= 0 else
               f"{len(later)} checkpoint(s) moved to {target}: this start begins at step 0")
    run_dir.write_event("checkpoints_set_aside", message)
    log(message)


@dataclass(frozen=True)
class ResumePlan:
    """Where a start of the job begins, decided before anything starts."""

    checkpoint: Path | None
    """The checkpoint to resume from; None: rollout step 0."""
    step: int = -1
    """The last rollout step it holds (-1: none)."""
    finished: bool = False
    """It holds every rollout step of the job: nothing to run."""
    changes: tuple[str, ...] = ()
    """Settings changed since it was written that the resume takes on (one line each,
    for the ``config_changed`` events)."""


RESUME_FREE = (
    "name", "output_dir", "resume", "max_restarts", "checkpoint_every", "checkpoint_keep_last",
    "eval", "logging",
    "colocate", "num_ranks", "rollout.call_timeout_s", "rollout.engine.num_threads",
    "rollout.engine.num_cpus", "rollout.engine.num_gpus", "rollout.engine.resources",
    "rollout.engine.device", "trainer.dp_size", "trainer.cp_size", "trainer.tp_size",
    "trainer.num_cpus_per_rank", "trainer.num_threads", "trainer.num_gpus_per_rank",
    "trainer.resources", "trainer.allow_cross_node", "trainer.collective_timeout_s",
    "trainer.call_timeout_s", "trainer.max_tokens_per_micro_batch", "trainer.packing",
    "trainer.weight_sync", "critic.dp_size", "critic.cp_size")
"""Settings a resume may change silently: where and how the job runs, evaluation and
logging, never what it trains (a layout changes nothing: docs/loss-aggregation.md)."""
RESUME_LOGGED = ("num_steps", "trainer.optimizer.lr", "trainer.optimizer.warmup_steps",
                 "trainer.optimizer.schedule", "trainer.optimizer.min_lr_ratio",
                 "critic.optimizer.lr", "critic.optimizer.warmup_steps",
                 "critic.optimizer.schedule", "critic.optimizer.min_lr_ratio")
"""Settings a resume may change, said in a ``config_changed`` event: the learning-rate
schedules (the policy's and the critic's) from the resumed step on, and how many rollout
steps the job has."""


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict) or not data:
        return {prefix: data}
    return {key: value for name, item in data.items()
            for key, value in _flat(item, f"{prefix}{name}.").items()}


def _within(field: str, names: tuple[str, ...]) -> bool:
    return any(field == name or field.startswith(name + ".") for name in names)


def resume_changes(config: JobConfig, stored: Path, force: bool) -> tuple[str, ...]:
    """The settings of ``config`` that differ from ``stored`` (a job's config.json) and
    matter to a resume: ConfigError naming each one that breaks an exact continuation
    (unless ``force``); the allowed ones, one line each."""
    if not stored.is_file():
        if force:
            return (f"{stored} is missing: the settings were not compared (--force)",)
        raise ConfigError("", [ConfigProblem("", (
            f"--resume: {stored} is missing, so this config cannot be checked against the "
            "one the checkpoint was trained with; pass --force to resume anyway"))])
    # the checkpoint's job folder is someone else's too: its config.json is no link
    saved = json.loads(read_inside(stored.parent, stored.name))
    old = {k.removesuffix("."): v for k, v in _flat(saved).items()}
    new = {k.removesuffix("."): v for k, v in _flat(config.model_dump(mode="json")).items()}
    changed = sorted(field for field in old if new.get(field, "<unset>") != old[field]
                     and not _within(field, RESUME_FREE))
    refused = [field for field in changed if not _within(field, RESUME_LOGGED)]
    if refused and not force:
        raise ConfigError("", [ConfigProblem(field, (
            f"was {json.dumps(old[field])} when the checkpoints in {stored.parent} were "
            f"written, is {json.dumps(new.get(field))} now: the resumed run would not "
            "continue the same training; set it back, pass --force to resume anyway, or "
            "use another --output-dir")) for field in refused])
    return tuple(f"{field}: {json.dumps(old[field])} → {json.dumps(new.get(field))}"
                 + (" (--force)" if field in refused else "") for field in changed)


def plan_resume(config: JobConfig, run_dir: RunDir, named: Path | None, force: bool,
                log: Callable[[str], None]) -> ResumePlan:
    """Where this start begins (no actor needed): ``named`` (a checkpoint folder, its
    ``latest`` link too), else the job folder's newest readable checkpoint when
    ``config.resume``; the job folder's checkpoints after it (unreadable ones, or all of
    them when it is in another job or there is none) are set aside. ConfigError for a
    named checkpoint that cannot be read or a changed setting that breaks exactness
    (``force``: resume anyway)."""
    if named is not None:
        folder = Path(named).resolve()
        if why := checkpoint_check.escapes(folder):
            raise _refused(Path(named), why)
        reason = (unreadable(folder) if (folder / DRIVER_STATE).is_file()
                  else f"not a checkpoint folder (no {DRIVER_STATE})")
        if reason:
            raise ConfigError("", [ConfigProblem("", f"--resume: {named}: {reason}")])
    else:
        folder = newest_readable(run_dir, log, refuse_hostile=True) if config.resume \
            else None
    if folder is None:
        set_aside(run_dir, -1, log)
        return ResumePlan(None)
    step = int(json.loads((folder / DRIVER_STATE).read_text())["step"])
    if step >= config.num_steps - 1:
        return ResumePlan(folder, step, finished=True)
    changes = resume_changes(config, folder.parent.parent / CONFIG_FILE, force)
    in_job = folder.parent.resolve() == run_dir.checkpoints_dir.resolve()
    set_aside(run_dir, step if in_job else -1, log)
    return ResumePlan(folder, step, changes=changes)


def truncate_rows_after(run_dir: RunDir, step: int, num_updates_per_rollout: int) -> None:
    """Drop the rows a resume from rollout step ``step`` repeats: rollout steps after it,
    their optimizer steps, the evaluations of the weights after it."""
    truncate_after(run_dir.metrics_file, step)
    truncate_after(run_dir.updates_file, (step + 1) * num_updates_per_rollout - 1)
    truncate_after(run_dir.eval_file, step)
    truncate_after(run_dir.samples_file, step)


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


def unreadable(folder: str | Path, full: bool = False) -> str | None:
    """Why a committed checkpoint cannot be resumed from, or None: every driver file is
    read (a pickle where the rollouts belong is refused), the trainer's headers too
    (``full``: every byte of the shards against its CRC-32, `tally checkpoint verify`)."""
    folder = Path(folder)
    try:
        checkpoint_check.confine(folder)  # no link, no stored path out, before any
        checkpoint_check.check_manifest(folder, full)  # file is parsed
        load_driver_state(folder)
    except Exception as err:  # any failure to read is the answer
        return f"{type(err).__name__}: {str(err).strip()[:300]}"
    return checkpoint_check.unreadable(folder, full)


def _rollouts_as_data(batches: dict[int, RolloutBatch]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    tensors, header = {}, {}
    for step, batch in batches.items():
        header[str(step)] = {name: getattr(batch, name) for name in SCALAR_FIELDS}
        header[str(step)]["samples"] = [record.to_json() for record in batch.samples]
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
    return {int(step): RolloutBatch(  # (a checkpoint before samples.jsonl has none)
        samples=[SampleRecord.from_json(row) for row in scalars.pop("samples", [])],
        **scalars, **{name: values.get(f"{step}/{name}") for name in _tensor_fields()})
        for step, scalars in header.items()}


def _tensor_fields() -> list[str]:
    return [f.name for f in fields(RolloutBatch) if f.init and f.name not in SCALAR_FIELDS]
