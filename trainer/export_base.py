"""The base model a LoRA checkpoint's export merges into, found and read confined.

``base_model_name_or_path`` (the adapter config) is the one path a checkpoint stores
absolute by design: Tally writes its job's model folder there. The rule for it
(:func:`base_folder`):

- ``base`` (``tally export --base DIR``, a folder the user names) replaces it;
- otherwise it is followed only as an absolute path to an existing folder: never
  relative to wherever the export runs, never a hub id;
- either way the folder is read confined (rollout/confined.py): its index and weight
  files opened without following a link, the index's file names relative and inside
  the folder. A base folder of links (a Hugging Face cache snapshot) is refused, naming
  the link: copy one into a plain folder first.

What the rule does not stop: a checkpoint from elsewhere may name another local model
folder as its base, and the merged export then holds that model's weights. ``--base``
is how a user who did not write the checkpoint says which base is meant.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from rollout.adapters import ADAPTER_CONFIG
from rollout.confined import Escapes, open_inside, read_inside, stored_path
from trainer.checkpoint import ADAPTER_DIR
from trainer.lora import merged

INDEX = "model.safetensors.index.json"


class ExportError(ValueError):
    """The checkpoint cannot be exported (said in one line)."""


@contextmanager
def open_weights(folder: Path, relative: str) -> Iterator[Any]:
    """safe_open of ``folder/relative`` opened by :func:`open_inside` (no link followed):
    safetensors takes a path, so it is given /proc/self/fd/N, the file already opened,
    never the name again (Linux)."""
    descriptor = open_inside(folder, relative, f"{folder}/{relative}")
    try:
        with safe_open(f"/proc/self/fd/{descriptor}", framework="pt") as f:
            yield f
    finally:
        os.close(descriptor)


def base_folder(lora_config: dict, checkpoint: Path, base: Path | None) -> Path:
    """The base model folder ``checkpoint``'s adapters merge into, by the rule above."""
    named = lora_config.get("base_model_name_or_path")
    if base is None and not named:
        raise ExportError(f"{checkpoint}: its {ADAPTER_DIR}/{ADAPTER_CONFIG} names no base "
                          "model (base_model_name_or_path); pass --base, or export it "
                          "with --adapter")
    label = ("--base" if base is not None else
             f"{ADAPTER_DIR}/{ADAPTER_CONFIG}: base_model_name_or_path")
    folder = base if base is not None else Path(str(named))
    if base is None and not folder.is_absolute():
        raise ExportError(f"{checkpoint}: {label} is {str(named)!r}, not an absolute "
                          "folder; pass the base model folder with --base")
    if not folder.is_dir():
        raise ExportError(f"{checkpoint}: {label} names {folder}, which is not a folder "
                          "here; pass the base model folder with --base")
    try:
        found = folder_files(folder)
    except Escapes as err:
        raise ExportError(f"{label} {folder}: {err}") from None
    if not found:
        raise ExportError(f"{checkpoint}: the base model of its adapters, {folder}, has no "
                          "safetensors weights here; export the adapters with --adapter")
    return folder


def folder_files(folder: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (relative) of a Hugging Face folder holding it,
    read confined (Escapes for a link, or an index naming a file outside the folder)."""
    try:
        weight_map = json.loads(read_inside(folder, INDEX))["weight_map"]
    except FileNotFoundError:
        weight_map = None
    if weight_map is not None:
        for file in set(weight_map.values()):
            stored_path(file, f"{folder}/{INDEX}")
        return {str(name): str(file) for name, file in weight_map.items()}
    try:
        with open_weights(folder, "model.safetensors") as f:
            return dict.fromkeys(f.keys(), "model.safetensors")
    except FileNotFoundError:
        return {}


def folder_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for name, file in folder_files(folder).items():
        with open_weights(folder, file) as f:
            shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def merged_groups(base: Path, factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  scaling: float) -> Callable[[list], Iterator[dict[str, torch.Tensor]]]:
    """Each group's base tensors, an adapted weight merged with its factors."""
    files = folder_files(base)
    by_weight = {f"{module}.weight": pair for module, pair in factors.items()}
    if missing := sorted(set(by_weight) - set(files)):
        raise ExportError(f"{base}: has no weight {missing[0]} for the checkpoint's adapter")

    def read(groups: list) -> Iterator[dict[str, torch.Tensor]]:
        for group in groups:
            tensors = {}
            for spec in group:
                with open_weights(base, files[spec.name]) as f:
                    weight = f.get_tensor(spec.name)
                if spec.name in by_weight:
                    a, b = by_weight[spec.name]
                    if (b.shape[0], a.shape[1]) != tuple(weight.shape):
                        raise ExportError(f"{base}: {spec.name} is {tuple(weight.shape)}, "
                                          f"its adapter is {tuple(b.shape)} × "
                                          f"{tuple(a.shape)}: not this adapter's base")
                    weight = merged(weight.float(), a, b, scaling)
                tensors[spec.name] = weight
            yield tensors

    return read
