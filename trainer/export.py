"""A checkpoint as a Hugging Face folder: what ``tally export`` and the end of a job write.

    export_checkpoint(step_N, out_dir, dtype="float32")
        out_dir/model.safetensors            (or model-0000k-of-0000n.safetensors + index)
        out_dir/config.json, generation_config.json, tokenizer files

Written a group of tensors at a time (at most ``max_shard_bytes`` in memory, one
safetensors file each): the export never holds the whole model, whatever its size. A
sharded checkpoint (trainer/checkpoint.py) is read with DCP without any process group,
each tensor whole, from however many ranks wrote it; the Megatron backend's Hugging Face
folder is read tensor by tensor. The folder is written beside ``out_dir`` and renamed
into place, so a reader never sees half an export.

A LoRA checkpoint (``adapter/`` beside the shards, trainer/lora.py) holds the adapters
only: its export reads the base model folder its adapter config names, tensor by tensor,
and writes each adapted weight merged, W + (alpha/r)·B·A (computed in float64);
``adapter=True`` copies peft's adapter folder instead.

A checkpoint is read confined (rollout/confined.py, trainer/checkpoint.py ``confine``)
before anything of it is: a link anywhere in it (``model_config/README.md ->
~/.tally/session-key``, ``adapter/ssh -> ~/.ssh``), or a stored path that is absolute or
climbs out (a manifest's names, DCP's ``relative_path``), is refused naming the file
and the path; every file is then opened without following a link, and the export
writes only files it creates itself (config and tokenizer files copied by content). The
base model of a LoRA checkpoint is found and read by trainer/export_base.py.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollout.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, group_factors
from rollout.confined import (
    Escapes,
    copy_regular_files,
    create_owned,
    read_inside,
    regular_files,
)
from rollout.weight_bucket import DTYPES, plan_buckets
from trainer.checkpoint import (
    ADAPTER_DIR,
    MODEL_CONFIG_DIR,
    MODEL_DIR,
    SHARDS_DIR,
    checkpoints,
    is_sharded,
    load_planner,
)
from trainer.checkpoint_check import confine
from trainer.dcp_metadata import UnsafeMetadata
from trainer.export_base import (
    INDEX,
    ExportError,
    base_folder,
    folder_shapes,
    merged_groups,
    open_weights,
)

MODEL_PREFIX = "model."
"""DCP flattens {"model": state_dict} into "model.<HF name>"."""
DEFAULT_SHARD_BYTES = 2 << 30
__all__ = ["ExportError", "export_checkpoint"]  # ExportError lives in export_base


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str = "float32",
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES, adapter: bool = False,
                      base: str | Path | None = None) -> Path:
    """Write ``checkpoint``'s weights in ``dtype`` as a Hugging Face folder at ``out_dir``
    (replacing an earlier export there); returns ``out_dir``. A LoRA checkpoint is merged
    into its base model (W + (alpha/r)·B·A: a folder ``from_pretrained`` loads without
    peft; ``base``: that model folder instead of the one its adapter config names, see
    trainer/export_base.py), or with ``adapter`` written as peft's adapter folder.
    ExportError (one line) for a checkpoint that is missing, damaged or reaches outside
    its folder."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    if dtype not in DTYPES:
        raise ExportError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if not checkpoint.is_dir():
        raise ExportError(_not_there(checkpoint))
    try:
        confine(checkpoint)  # before any file of it is parsed
    except (Escapes, UnsafeMetadata) as err:
        raise ExportError(f"{checkpoint}: {err}; refused: a checkpoint is never read "
                          "outside its folder") from None
    except (ValueError, OSError) as err:  # damaged: a metadata that is no DCP metadata
        raise ExportError(f"{checkpoint}: {err}") from None
    try:
        return _export(checkpoint, out, dtype, max_shard_bytes, adapter,
                       None if base is None else Path(base))
    except Escapes as err:  # swapped in since the check above
        raise ExportError(f"{checkpoint}: {err}") from None


def _not_there(checkpoint: Path) -> str:
    found = [folder.name for folder in checkpoints(checkpoint.parent)]
    return (f"{checkpoint}: no such checkpoint folder; {checkpoint.parent} holds "
            + (f"the step folders {', '.join(sorted(found))}" if found else
               "no step folders"))


def _export(checkpoint: Path, out: Path, dtype: str, max_shard_bytes: int, adapter: bool,
            base: Path | None) -> Path:
    config_dir = MODEL_CONFIG_DIR if is_sharded(checkpoint) else MODEL_DIR
    if not (checkpoint / config_dir / "config.json").is_file():
        raise ExportError(f"{checkpoint}: not a Tally checkpoint (no {config_dir}/"
                          "config.json)")
    if is_sharded(checkpoint):  # before any weight is read: its metadata is a pickle
        from trainer.dcp_metadata import SafeFileSystemReader

        try:
            SafeFileSystemReader(str(checkpoint / SHARDS_DIR)).read_metadata()
        except (UnsafeMetadata, ValueError, OSError) as err:
            raise ExportError(f"{checkpoint}: {err}") from None
    adapters = checkpoint / ADAPTER_DIR
    if adapter and not adapters.is_dir():
        raise ExportError(f"--adapter: {checkpoint} holds full weights (its job trained "
                          "without trainer.lora); export it without --adapter")
    if adapter and dtype != "float32":
        raise ExportError(f"--dtype {dtype}: --adapter copies the trained fp32 adapters as "
                          "they are; drop --dtype")
    if adapter:
        staging = _staging(out)
        copy_regular_files(adapters, staging, f"{checkpoint.name}/{ADAPTER_DIR}")
        return _publish(staging, out)
    config = json.loads(read_inside(checkpoint, f"{config_dir}/config.json"))
    if adapters.is_dir():
        lora_config, factors = _read_adapters(checkpoint)
        folder = base_folder(lora_config, checkpoint, base)
        scaling = float(lora_config["lora_alpha"]) / int(lora_config["r"])
        shapes = folder_shapes(folder)
        read = merged_groups(folder, factors, scaling)
    else:
        shapes = _stored_shapes(checkpoint)
        if any(name.startswith(PEFT_PREFIX) for name in shapes):
            raise ExportError(f"{checkpoint}: holds LoRA adapters but no {ADAPTER_DIR}/ "
                              "folder to merge them from (a damaged checkpoint)")
        read = functools.partial(_read_groups, checkpoint)
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)  # from_pretrained re-ties it to the embeddings
    staging = _staging(out)
    groups = plan_buckets(shapes.items(), dtype, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))])
    weight_map = {}
    for name, tensors in zip(names, read(groups), strict=True):
        save_file({k: v.to(DTYPES[dtype]).contiguous() for k, v in tensors.items()},
                  str(staging / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        del tensors
    if len(groups) > 1:
        total = sum(spec.num_bytes for group in groups for spec in group)
        _write(staging / INDEX, json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode())
    for file in regular_files(checkpoint / config_dir, f"{checkpoint.name}/{config_dir}"):
        if len(file.parts) == 1 and file.name != "config.json" and \
                not file.name.endswith((".safetensors", ".index.json")):
            _write(staging / file.name, read_inside(checkpoint, f"{config_dir}/{file}"))
    _write(staging / "config.json", json.dumps(
        {**config, "torch_dtype": dtype, "dtype": dtype}, indent=2).encode())
    return _publish(staging, out)


def _write(path: Path, data: bytes) -> None:
    """A new regular file of the export (never through a link, never over a file)."""
    with os.fdopen(create_owned(path, 0o644), "wb") as file:
        file.write(data)


def _read_adapters(checkpoint: Path
                   ) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(adapter_config.json, module -> (A, B)) of the checkpoint's adapter folder, read
    confined (rollout.adapters.read_peft_folder opens the names as given)."""
    config = json.loads(read_inside(checkpoint, f"{ADAPTER_DIR}/{ADAPTER_CONFIG}"))
    weights = f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}"
    with open_weights(checkpoint, weights) as f:
        named = [(name.removeprefix(PEFT_PREFIX).removesuffix(".weight"), f.get_tensor(name))
                 for name in f.keys()]  # noqa: SIM118
    return config, group_factors(named, f"{checkpoint.name}/{weights}")


def _staging(out: Path) -> Path:
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, out: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def _stored_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape of every weight the checkpoint holds."""
    if is_sharded(checkpoint):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from trainer.dcp_metadata import SafeFileSystemReader

        metadata = SafeFileSystemReader(str(checkpoint / SHARDS_DIR)).read_metadata()
        return {key.removeprefix(MODEL_PREFIX): tuple(item.size)
                for key, item in metadata.state_dict_metadata.items()
                if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata)}
    with open_weights(checkpoint, f"{MODEL_DIR}/model.safetensors") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118


def _read_groups(checkpoint: Path, groups: list) -> Iterator[dict[str, torch.Tensor]]:
    """Each group's tensors whole, in the stored dtype, one group in memory at a time."""
    if not is_sharded(checkpoint):
        with open_weights(checkpoint, f"{MODEL_DIR}/model.safetensors") as f:
            for group in groups:
                yield {spec.name: f.get_tensor(spec.name) for spec in group}
        return
    from torch.distributed import checkpoint as dcp

    from trainer.dcp_metadata import SafeFileSystemReader

    reader = SafeFileSystemReader(str(checkpoint / SHARDS_DIR))
    stored = reader.read_metadata().state_dict_metadata
    for group in groups:
        state = {MODEL_PREFIX + spec.name: torch.empty(
            spec.shape, dtype=stored[MODEL_PREFIX + spec.name].properties.dtype)
            for spec in group}
        with warnings.catch_warnings():  # "assuming ... a single process": it is one
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=load_planner(),
                     no_dist=True)
        yield {key.removeprefix(MODEL_PREFIX): tensor for key, tensor in state.items()}
