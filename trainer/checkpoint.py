"""Checkpoints: the model as a Hugging Face folder (safetensors, loadable with
``from_pretrained``) and the trainer state (optimizer, scheduler, RNG) beside it.

This module is the one writer and reader of that format: the backends hand it their
weights (as HF names), their full optimizer state and their scheduler; the driver's part
(services/driver/checkpoint.py) goes in the same folder.

A checkpoint is written under ``<name>.tmp`` and renamed when complete (see
``commit_checkpoint``), so a crash never leaves a half-written checkpoint that a resume
could load: ``checkpoints`` only sees committed folders, newest first (a resume whose
newest one is unreadable falls back to the one before). The trainer state loads with
``torch.load(weights_only=True)``: a checkpoint is data, never code.
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

MODEL_DIR, TRAINER_STATE = "model", "trainer_state.pt"
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
    config.save_pretrained(out)  # type: ignore[attr-defined]
    for name in TOKENIZER_FILES:
        source = Path(model_path) / name
        if source.exists() and not (out / name).exists():
            shutil.copy(source, out / name)


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


def trainer_state(optimizer_state: dict, scheduler: torch.optim.lr_scheduler.LRScheduler
                  ) -> dict:
    """What a checkpoint keeps besides the weights."""
    return {"optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                    "python": random.getstate()}}


def restore_schedule_and_rng(state: dict, scheduler: torch.optim.lr_scheduler.LRScheduler
                             ) -> None:
    """Collective: rank 0 read ``state``; every rank restores its scheduler and RNG."""
    holder = [state.get("scheduler"), state.get("rng")]
    dist.broadcast_object_list(holder, src=0)
    scheduler_state, rng = holder
    scheduler.load_state_dict(scheduler_state)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def save_trainer_checkpoint(path: str, model_path: str, model: torch.nn.Module,
                            model_state: dict[str, torch.Tensor], trainer_state: dict) -> None:
    save_hf_model(Path(path) / MODEL_DIR, model_path, model.config, model_state)
    torch.save(_to_safe(trainer_state), Path(path) / TRAINER_STATE)


def load_trainer_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], dict]:
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


def unreadable(path: str | Path) -> str | None:
    """Why the trainer's part of a committed checkpoint cannot be loaded (a truncated or
    corrupt file), or None; reads the headers only (mmap), so the ranks are never asked to
    load a broken one. The driver's part is checked by services/driver/checkpoint.py."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path / MODEL_DIR / "model.safetensors"), framework="pt") as weights:
            list(weights.keys())
        torch.load(path / TRAINER_STATE, weights_only=True, mmap=True)
    except Exception as err:  # any failure to read is the answer
        return f"{type(err).__name__}: {str(err).strip()[:300]}"
    return None


def checkpoint_step(path: str | Path) -> int:
    return int(Path(path).name.removeprefix(STEP_PREFIX).removesuffix(OLD_SUFFIX))
