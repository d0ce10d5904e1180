"""Checkpoints: sharded model and optimizer state, each rank writing and reading its own
shards, and the trainer state (scheduler, RNG) beside them.

    step_N/
        shards/             torch.distributed.checkpoint (DCP): .metadata + one or more
                            __<rank>_<k>.distcp per rank ({"model": …, "optimizer": …})
        shards/manifest.json  every shard file's size and CRC-32 (what ``unreadable`` checks)
        trainer_state.pt    scheduler and RNG (rank 0's, restored on every rank)
        model_config/       config.json, generation config and tokenizer files: what
                            ``tally export`` needs to write a Hugging Face folder
        adapter/            under trainer.lora only: peft's adapter folder (the shards
                            then hold the adapters and their AdamW state, not the base)
        driver_state.json … the driver's part (services/driver/checkpoint.py)
        manifest.json       every file above: size and CRC-32, and the listing's digest
                            (FOLDER_MANIFEST; written at commit; a start checks sizes and
                            the small files' CRCs, `tally checkpoint verify` every byte)

Nothing is gathered on one rank: at 7 B the full fp32 weights and AdamW state would be
~84 GB. DCP reshards on load, so a job may resume at another DP (or CP) size. The Hugging
Face folder is an export (trainer/export.py), not the checkpoint. Every rank writes into
the same folder: on several nodes it must be on shared storage (as for any DCP user).

The Megatron backend still writes its older format here (``model/`` as a Hugging Face
folder of the gathered fp32 main params, ``trainer_state.pt`` with the full optimizer
state under HF names; trainer/backends/megatron/checkpoint.py): TP- and DP-independent,
but gathered on rank 0. Both formats are read by ``unreadable`` and the export.

A checkpoint is written under ``<name>.tmp`` and renamed when complete (see
``commit_checkpoint``), so a crash never leaves a half-written checkpoint that a resume
could load: ``checkpoints`` only sees committed folders, newest first (a resume whose
newest one is unreadable falls back to the one before). The trainer state loads with
``torch.load(weights_only=True)``, DCP's pickled ``shards/.metadata`` through a restricted
unpickler (trainer/dcp_metadata.py: only the classes a DCP metadata holds): a checkpoint
is data, never code. A checkpoint is also read confined (rollout/confined.py,
trainer/checkpoint_check.py): no link anywhere in it, no stored path (a manifest's names, DCP's
``relative_path``) that is absolute or climbs out; such a folder is refused, naming the
file and the path, before anything else of it is read.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from trainer.dcp_metadata import SafeFileSystemReader

MODEL_DIR, TRAINER_STATE = "model", "trainer_state.pt"
SHARDS_DIR, MANIFEST, MODEL_CONFIG_DIR = "shards", "manifest.json", "model_config"
ADAPTER_DIR = "adapter"
CRITIC_DIR = "critic"
"""The critic's part of a checkpoint (PPO with a critic): its own shards, trainer state
and model config, laid out like the policy's at the top."""
"""Under trainer.lora: peft's adapter folder of the step (the shards hold the adapters
and their AdamW state only; the frozen base is the job's model folder)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
STEP_PREFIX, TMP_SUFFIX, OLD_SUFFIX = "step_", ".tmp", ".old"


def save_hf_model(path: str | Path, model_path: str, config: object,
                  state_dict: dict[str, torch.Tensor]) -> None:
    """config.json and tokenizer files from the source folder, weights as safetensors."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # from_pretrained re-ties it to the embeddings
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_model_config(out, model_path, config)


def save_model_config(out: Path, model_path: str, config: object) -> None:
    """config.json, and the tokenizer and generation files of the source folder."""
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)  # type: ignore[attr-defined]
    for name in TOKENIZER_FILES:
        source = Path(model_path) / name
        if source.exists() and not (out / name).exists():
            shutil.copy(source, out / name)


def save_sharded(path: str | Path, state: dict[str, Any], trainer_state: dict,
                 model_path: str, model_config: object) -> None:
    """Collective: every rank writes its shards of ``state`` (DCP) and their digests;
    rank 0 adds the manifest, the trainer state and the model config."""
    from torch.distributed import checkpoint as dcp

    shards = Path(path) / SHARDS_DIR
    dcp.save(state, checkpoint_id=str(shards))
    from trainer.checkpoint_check import _digest

    own = {f.name: _digest(f) for f in sorted(shards.glob(f"__{dist.get_rank()}_*.distcp"))}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, own)
    if dist.get_rank() == 0:
        files = {name: d for part in parts for name, d in part.items()}
        files[".metadata"] = _digest(shards / ".metadata")
        (shards / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
        torch.save(_to_safe(trainer_state), Path(path) / TRAINER_STATE)
        save_model_config(Path(path) / MODEL_CONFIG_DIR, model_path, model_config)
    dist.barrier()


def _weights_only(planner: type) -> type:
    """``planner`` loading the non-tensor entries (the optimizer's param groups) with
    ``torch.load(weights_only=True)``: DCP's own planners unpickle them freely, and a
    checkpoint is data, never code to run."""

    class WeightsOnly(planner):  # type: ignore[misc, valid-type]
        def load_bytes(self, read_item: Any, value: Any) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnly


def load_planner(empty: bool = False) -> Any:
    """A DCP load planner that never unpickles (``empty``: it builds the whole nested
    state dict from the checkpoint's metadata, on one process)."""
    from torch.distributed.checkpoint import default_planner

    return _weights_only(default_planner._EmptyStateDictLoadPlanner if empty
                         else default_planner.DefaultLoadPlanner)()


def load_sharded(path: str | Path, state: dict[str, Any]) -> dict:
    """Collective: fill ``state`` (this rank's shards, as laid out now: DCP reshards) in
    place; rank 0 returns the trainer state, the others {}."""
    from torch.distributed import checkpoint as dcp

    dcp.load(state, storage_reader=SafeFileSystemReader(str(Path(path) / SHARDS_DIR)),
             planner=load_planner())
    if dist.get_rank() != 0:
        return {}
    # weights_only: a checkpoint folder is data, never code to run (a pickle can run any)
    return _from_safe(torch.load(Path(path) / TRAINER_STATE, weights_only=True))


def is_sharded(path: str | Path) -> bool:
    return (Path(path) / SHARDS_DIR).is_dir()


NDARRAY = "__ndarray__"
"""Marks a numpy array stored as a tensor (numpy's RNG state): ``weights_only`` loads
refuse pickled numpy objects."""


def _to_safe(value: Any) -> Any:
    """Numpy arrays and scalars -> tensors and numbers, recursively (what
    ``torch.load(weights_only=True)`` accepts)."""
    if isinstance(value, np.ndarray):
        return {NDARRAY: torch.from_numpy(value.astype(np.int64) if value.dtype == np.uint32
                                          else value.copy()), "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: _to_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_safe(item) for item in value)
    return value


def _from_safe(value: Any) -> Any:
    if isinstance(value, dict):
        if NDARRAY in value:
            return value[NDARRAY].numpy().astype(value["dtype"])
        return {key: _from_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_from_safe(item) for item in value)
    return value


def trainer_state(optimizer_state: dict | None,
                  scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict:
    """What a checkpoint keeps besides the weights (the optimizer state too, unless it is
    in the shards: None)."""
    state = {"scheduler": scheduler.state_dict(),
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                     "python": random.getstate()}}
    return state if optimizer_state is None else {"optimizer": optimizer_state, **state}


def restore_schedule_and_rng(state: dict, scheduler: torch.optim.lr_scheduler.LambdaLR
                             ) -> None:
    """Collective: rank 0 read ``state``; every rank restores its scheduler and RNG."""
    holder = [state.get("scheduler"), state.get("rng")]
    dist.broadcast_object_list(holder, src=0)
    scheduler_state, rng = holder
    configured = list(scheduler.base_lrs)  # this run's trainer.optimizer.lr
    scheduler.load_state_dict(scheduler_state)
    # A resume may change the lr (allowed, logged as config_changed): the schedule's
    # position comes from the checkpoint, its peak from this run's config.
    scheduler.base_lrs = configured
    for group, base, factor in zip(scheduler.optimizer.param_groups, configured,
                                   scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def save_trainer_checkpoint(path: str, model_path: str, model: torch.nn.Module,
                            model_state: dict[str, torch.Tensor], trainer_state: dict) -> None:
    save_hf_model(Path(path) / MODEL_DIR, model_path, model.config, model_state)
    torch.save(_to_safe(trainer_state), Path(path) / TRAINER_STATE)


def read_sharded_whole(path: str | Path) -> dict[str, Any]:
    """One process, no process group: the whole nested {"model", "optimizer"} state of a
    sharded checkpoint in memory (what a backend that gathers, Megatron, resumes from)."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        reader = SafeFileSystemReader(str(Path(path) / SHARDS_DIR))
        _load_state_dict(state, storage_reader=reader,
                         planner=load_planner(empty=True), no_dist=True)
    return state


def load_trainer_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Rank 0 of a backend that gathers: the full HF-named weights and the trainer state
    with the full optimizer state (torch's layout, HF names), from either format."""
    if is_sharded(path):
        whole = read_sharded_whole(path)
        saved = _from_safe(torch.load(Path(path) / TRAINER_STATE, weights_only=True))
        return whole["model"], {**saved, "optimizer": whole["optimizer"]}
    model_state = load_file(str(Path(path) / MODEL_DIR / "model.safetensors"))
    config = json.loads((Path(path) / MODEL_DIR / "config.json").read_text())
    if config.get("tie_word_embeddings") and "lm_head.weight" not in model_state:
        model_state["lm_head.weight"] = model_state["model.embed_tokens.weight"]
    # weights_only: a checkpoint folder is data, never code to run (a pickle can run any)
    trainer_state = _from_safe(torch.load(Path(path) / TRAINER_STATE, weights_only=True))
    return model_state, trainer_state


def staging_path(root: str | Path, step: int) -> Path:
    """Where step ``step``'s checkpoint is written before it is committed (a stale one, from
    a failed write, is removed first)."""
    path = Path(root) / f"{STEP_PREFIX}{step:08d}{TMP_SUFFIX}"
    if path.exists():
        shutil.rmtree(path)
    return path


def _fsync_tree(path: Path) -> None:
    """Files, then folders bottom-up, then the parent: the data is on disk before the
    rename that publishes it."""
    for folder, _, files in os.walk(path, topdown=False):
        for name in (*files, "."):
            descriptor = os.open(Path(folder) / name, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def commit_checkpoint(root: str | Path, step: int) -> Path:
    """Publish a fully written checkpoint: fsync it, rename an older one of the same step
    aside (``.old``), rename the new one in, then drop the old one; at every moment one
    of them is there (:func:`checkpoints` reads a ``.old`` whose successor is missing)."""
    root = Path(root)
    final = root / f"{STEP_PREFIX}{step:08d}"
    staging = final.with_name(final.name + TMP_SUFFIX)
    aside = final.with_name(final.name + OLD_SUFFIX)
    from trainer.checkpoint_check import write_manifest

    write_manifest(staging)  # complete now: every part, the driver's too, is written
    _fsync_tree(staging)
    if aside.exists():
        shutil.rmtree(aside)
    if final.exists():
        os.replace(final, aside)
    os.replace(staging, final)
    _fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)
    return final


def checkpoints(root: str | Path) -> list[Path]:
    """Committed checkpoints, newest first: staging folders are ignored; an old copy set
    aside counts only while its replacement is missing (a crash between the renames)."""
    root = Path(root)
    if not root.is_dir():
        return []
    names = {p.name for p in root.iterdir() if p.name.startswith(STEP_PREFIX)}
    done = [root / n for n in names if not n.endswith((TMP_SUFFIX, OLD_SUFFIX))]
    done += [root / n for n in names
             if n.endswith(OLD_SUFFIX) and n.removesuffix(OLD_SUFFIX) not in names]
    return sorted(done, key=lambda p: p.name.removesuffix(OLD_SUFFIX), reverse=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest committed checkpoint; staging folders are ignored."""
    found = checkpoints(root)
    return found[0] if found else None


def checkpoint_step(path: str | Path) -> int:
    return int(Path(path).name.removeprefix(STEP_PREFIX).removesuffix(OLD_SUFFIX))
