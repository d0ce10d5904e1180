r"""LoRA on the FSDP trainer: the adapted model, its names, and its adapters as files.

A target Linear W (frozen) becomes

    y = W x + (alpha / r) · B A dropout(x)        A: [r, in] (random), B: [out, r] (zeros)

through peft. Only A and B are trainable: they are the fp32 master weights the optimizer
steps (AdamW state for them alone), the base is cast to the compute dtype and never
changes. The objective, the step plan and the aggregation see log-probs, not
parameters, so every mode stays exact; FSDP sums the adapters' gradients over DP × CP as
it sums a full model's. The KL reference is the same base with the adapters disabled
(``peft``'s ``disable_adapter``): no second copy of the weights.

Names: peft's parameters are ``base_model.model.<HF module>.lora_A.default.weight``; the
engines receive ``<HF module>.lora_A`` and ``.lora_B`` (B scaled, rollout/adapters.py);
the adapter folder is peft's own (``adapter_config.json``, ``adapter_model.safetensors``
with ``base_model.model.<HF module>.lora_A.weight``) and ``PeftModel.from_pretrained``
loads it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from rollout.adapters import LORA_A, LORA_B, PEFT_PREFIX, wire_name, write_peft_folder
from trainer.config import LORA_ALL_LINEAR, LoraConfig

ADAPTER_NAME = "default"
"""peft's name of the one adapter Tally trains."""


class LoraTargetError(ValueError):
    """``trainer.lora.target_modules`` names something the model does not have."""


def linear_module_names(model: torch.nn.Module) -> set[str]:
    """The last name part of every Linear of the model but its output head (what
    ``target_modules`` entries match)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name.rpartition(".")[2] for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head}


def check_targets(config: LoraConfig, model: torch.nn.Module) -> None:
    """Raise, naming the field, when a target module is not a Linear of the model."""
    if config.target_modules == LORA_ALL_LINEAR:
        return
    known = linear_module_names(model)
    missing = [name for name in config.target_modules if name not in known]
    if missing:
        raise LoraTargetError(
            f"trainer.lora.target_modules: {', '.join(missing)} "
            f"{'is not a Linear module' if len(missing) == 1 else 'are not Linear modules'} "
            f"of the model; it has {', '.join(sorted(known))} (or use all-linear)")


def add_adapters(model: torch.nn.Module, config: LoraConfig, compute_dtype: torch.dtype
                 ) -> torch.nn.Module:
    """The peft model around ``model`` (in its master dtype): adapters in that dtype and
    trainable, everything else frozen and cast to ``compute_dtype``."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_targets(config, model)
    peft_config = PeftLoraConfig(r=config.rank, lora_alpha=config.alpha,
                                 lora_dropout=config.dropout, bias="none",
                                 target_modules=config.target_modules, task_type="CAUSAL_LM")
    master = next(model.parameters()).dtype
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                category=FutureWarning)
        adapted = get_peft_model(model, peft_config, autocast_adapter_dtype=False)
    for param in adapted.parameters():
        if param.requires_grad:
            param.data = param.data.to(master)
        elif param.dtype != compute_dtype and param.is_floating_point():
            param.data = param.data.to(compute_dtype)
    return adapted


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM, adapted or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(HF module name, peft LoRA layer) of every adapted module, in model order."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
            yield name.removeprefix(PEFT_PREFIX), module


def wire_shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """The engine-side names and full shapes of one adapter sync, in send order."""
    shapes = []
    for module, layer in lora_layers(model):
        linear = layer.get_base_layer()
        rank = layer.r[ADAPTER_NAME]
        shapes += [(wire_name(module, LORA_A), (rank, linear.in_features)),
                   (wire_name(module, LORA_B), (linear.out_features, rank))]
    return shapes


def adapter_params(model: torch.nn.Module
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """HF module -> (A, B, alpha / r) of every adapted module, in model order: the
    parameters as this rank holds them (its shards under FSDP)."""
    return {module: (layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight,
                     float(layer.scaling[ADAPTER_NAME]))
            for module, layer in lora_layers(model)}


def wire_sources(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, float]]:
    """Engine-side name -> (this rank's parameter, or its shard, and the factor it is sent
    multiplied by): A as it is, B times alpha / r."""
    sources = {}
    for module, (a, b, scale) in adapter_params(model).items():
        sources[wire_name(module, LORA_A)] = (a, 1.0)
        sources[wire_name(module, LORA_B)] = (b, scale)
    return sources


def save_adapter_folder(out: str | Path, factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
                        config: LoraConfig, base_model_path: str) -> Path:
    """peft's adapter folder from module -> the full (A, B), the base recorded by its
    absolute path (``tally export`` merges into it from any folder)."""
    return write_peft_folder(out, factors, config.rank, config.alpha,
                             str(Path(base_model_path).resolve()), config.dropout)


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
           ) -> torch.Tensor:
    """W + scaling · B A, computed in float64 and returned in W's dtype."""
    delta = scaling * (b.double() @ a.double())
    return (weight.double() + delta).to(weight.dtype)
