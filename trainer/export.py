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
"""

from __future__ import annotations

import functools
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollout.adapters import PEFT_PREFIX, read_peft_folder
from rollout.weight_bucket import DTYPES, plan_buckets
from trainer.checkpoint import (
    ADAPTER_DIR,
    MODEL_CONFIG_DIR,
    MODEL_DIR,
    SHARDS_DIR,
    is_sharded,
    load_planner,
)
from trainer.lora import merged

MODEL_PREFIX = "model."
"""DCP flattens {"model": state_dict} into "model.<HF name>"."""
DEFAULT_SHARD_BYTES = 2 << 30


class ExportError(ValueError):
    """The checkpoint cannot be exported (said in one line)."""


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str = "float32",
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES, adapter: bool = False
                      ) -> Path:
    """Write ``checkpoint``'s weights in ``dtype`` as a Hugging Face folder at ``out_dir``
    (replacing an earlier export there); returns ``out_dir``. A LoRA checkpoint is merged
    into its base model (W + (alpha/r)·B·A: a folder ``from_pretrained`` loads without
    peft), or with ``adapter`` written as peft's adapter folder."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    if dtype not in DTYPES:
        raise ExportError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    config_dir = checkpoint / (MODEL_CONFIG_DIR if is_sharded(checkpoint) else MODEL_DIR)
    if not (config_dir / "config.json").is_file():
        raise ExportError(f"{checkpoint}: not a Tally checkpoint (no {config_dir.name}/"
                          "config.json)")
    if is_sharded(checkpoint):  # before any weight is read: its metadata is a pickle
        from trainer.dcp_metadata import SafeFileSystemReader, UnsafeMetadata

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
        shutil.copytree(adapters, staging, dirs_exist_ok=True)
        return _publish(staging, out)
    config = json.loads((config_dir / "config.json").read_text())
    if adapters.is_dir():
        lora_config, factors = read_peft_folder(adapters)
        base = _base_folder(lora_config, checkpoint)
        scaling = float(lora_config["lora_alpha"]) / int(lora_config["r"])
        shapes = _folder_shapes(base)
        read = _merged_groups(base, factors, scaling)
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
        (staging / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for file in config_dir.iterdir():
        if file.is_file() and not file.name.endswith((".safetensors", ".index.json")):
            shutil.copy(file, staging / file.name)
    (staging / "config.json").write_text(json.dumps(
        {**config, "torch_dtype": dtype, "dtype": dtype}, indent=2))
    return _publish(staging, out)


def _staging(out: Path) -> Path:
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, out: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def _base_folder(lora_config: dict, checkpoint: Path) -> Path:
    """The base model a LoRA checkpoint's adapters apply to (its job's model folder)."""
    named = lora_config.get("base_model_name_or_path")
    if not named:
        raise ExportError(f"{checkpoint}: its {ADAPTER_DIR}/adapter_config.json names no "
                          "base model (base_model_name_or_path); export it with --adapter")
    base = Path(str(named))
    if not _folder_files(base):
        raise ExportError(f"{checkpoint}: the base model of its adapters, {base}, has no "
                          "safetensors weights here; export the adapters with --adapter")
    return base


def _folder_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of a Hugging Face folder that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _folder_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for name, file in _folder_files(folder).items():
        with safe_open(str(file), framework="pt") as f:
            shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _merged_groups(base: Path, factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   scaling: float) -> Callable[[list], Iterator[dict[str, torch.Tensor]]]:
    """Each group's base tensors, an adapted weight merged with its factors."""
    files = _folder_files(base)
    by_weight = {f"{module}.weight": pair for module, pair in factors.items()}
    if missing := sorted(set(by_weight) - set(files)):
        raise ExportError(f"{base}: has no weight {missing[0]} for the checkpoint's adapter")

    def read(groups: list) -> Iterator[dict[str, torch.Tensor]]:
        for group in groups:
            tensors = {}
            for spec in group:
                with safe_open(str(files[spec.name]), framework="pt") as f:
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


def _stored_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape of every weight the checkpoint holds."""
    if is_sharded(checkpoint):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from trainer.dcp_metadata import SafeFileSystemReader

        metadata = SafeFileSystemReader(str(checkpoint / SHARDS_DIR)).read_metadata()
        return {key.removeprefix(MODEL_PREFIX): tuple(item.size)
                for key, item in metadata.state_dict_metadata.items()
                if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata)}
    with safe_open(str(checkpoint / MODEL_DIR / "model.safetensors"), framework="pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118


def _read_groups(checkpoint: Path, groups: list) -> Iterator[dict[str, torch.Tensor]]:
    """Each group's tensors whole, in the stored dtype, one group in memory at a time."""
    if not is_sharded(checkpoint):
        with safe_open(str(checkpoint / MODEL_DIR / "model.safetensors"),
                       framework="pt") as f:
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
