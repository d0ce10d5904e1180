"""LoRA adapters as the engines receive them, and how a torch engine applies them.

A LoRA sync sends, for every adapted Linear module ``m`` of the Hugging Face model,

    m.lora_A   [r, in]    A
    m.lora_B   [out, r]   (alpha / r) · B      (the scale folded in: no config to ship)

in the ordinary weight buckets (rollout/weight_bucket.py). The engine adds the low-rank
term to the module's output, unmerged:

    y = W x + (s·B) (A x)

so the frozen base weights are never touched or copied, a bf16 engine does not round a
small update away (merging W + s·B·A into bf16 weights would), and a new version is a
swap of the small factors. A version is checked whole (every module known and Linear,
both factors present, shapes agreeing) before any factor is swapped in.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

LORA_A, LORA_B = "lora_A", "lora_B"
"""Suffixes of the two factors' names on the wire: ``<module>.lora_A``, ``<module>.lora_B``."""


def wire_name(module: str, factor: str) -> str:
    return f"{module}.{factor}"


def split_wire_name(name: str) -> tuple[str, str] | None:
    """``model.layers.0.self_attn.q_proj.lora_A`` -> (module, "lora_A"); None for a plain
    weight name."""
    module, _, factor = name.rpartition(".")
    return (module, factor) if module and factor in (LORA_A, LORA_B) else None


def is_adapter_sync(names: list[str]) -> bool:
    """A sync is adapters only or whole weights only; a mixture is refused."""
    adapters = [split_wire_name(name) is not None for name in names]
    if any(adapters) and not all(adapters):
        plain = next(name for name, is_adapter in zip(names, adapters, strict=True)
                     if not is_adapter)
        raise ValueError(f"weight sync: {plain!r} is a whole weight in a sync of adapters")
    return bool(adapters) and all(adapters)


def check_fits(model: torch.nn.Module,
               factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Raise, naming the module, unless every module of ``factors`` is a Linear of
    ``model`` whose shapes its (A, B) fit."""
    modules = dict(model.named_modules())
    for module, (a, b) in factors.items():
        linear = modules.get(module)
        if not isinstance(linear, torch.nn.Linear):
            raise KeyError(f"adapter sync: {wire_name(module, LORA_A)!r}: the model has no "
                           f"Linear {module!r}")
        if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != linear.in_features
                or b.shape[0] != linear.out_features or a.shape[0] != b.shape[1]):
            raise ValueError(f"adapter sync: {module}: factors {tuple(a.shape)} and "
                             f"{tuple(b.shape)} do not fit Linear({linear.in_features}, "
                             f"{linear.out_features})")


class EngineAdapters:
    """The adapters a torch engine serves: a forward hook per adapted module adds
    (s·B)(A x) to its output; :meth:`load` swaps in a new version."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}

    @torch.no_grad()
    def load(self, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Check the whole version (module -> (A, s·B)) against the model, then copy its
        factors (in the engine's dtype and device) and hook any module seen for the
        first time."""
        check_fits(self.model, factors)
        modules = dict(self.model.named_modules())
        weight = next(self.model.parameters())
        served = {module: (a.to(weight.device, weight.dtype, copy=True),
                           b.to(weight.device, weight.dtype, copy=True))
                  for module, (a, b) in factors.items()}
        for module in set(self.hooks) - set(served):  # a module no longer adapted
            self.hooks.pop(module).remove()
        for module in served:
            if module not in self.hooks:
                self.hooks[module] = modules[module].register_forward_hook(
                    functools.partial(self._add_low_rank, module))
        self.factors = served

    def _add_low_rank(self, module: str, _linear: torch.nn.Module, args: tuple,
                      output: torch.Tensor) -> torch.Tensor:
        a, b = self.factors[module]
        return output + F.linear(F.linear(args[0].to(a.dtype), a), b).to(output.dtype)


PEFT_PREFIX = "base_model.model."
"""What peft puts before every Hugging Face name."""
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def write_peft_folder(out: str | Path, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                      rank: int, alpha: float, base_model_path: str,
                      dropout: float = 0.0) -> Path:
    """peft's LoRA adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
    from module -> (A, B), without needing peft: ``PeftModel.from_pretrained`` and SGLang's
    /load_lora_adapter read it, ``tally export`` merges it."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in factors.items():
        tensors[f"{PEFT_PREFIX}{module}.{LORA_A}.weight"] = a.detach().cpu().contiguous()
        tensors[f"{PEFT_PREFIX}{module}.{LORA_B}.weight"] = b.detach().cpu().contiguous()
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "lora_dropout": dropout, "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted({module.rpartition(".")[2] for module in factors}),
              "base_model_name_or_path": str(base_model_path), "inference_mode": True}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return out


def read_peft_folder(folder: str | Path
                     ) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(adapter_config.json, module -> (A, B)) of a peft LoRA folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    named = ((name.removeprefix(PEFT_PREFIX).removesuffix(".weight"), tensor)
             for name, tensor in load_file(str(folder / ADAPTER_WEIGHTS)).items())
    return config, group_factors(named, str(folder / ADAPTER_WEIGHTS))


def group_factors(named: Iterable[tuple[str, torch.Tensor]], where: str
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, B) from (``<module>.lora_A``/``.lora_B``, tensor) pairs; raises,
    naming ``where``, for a name that is no factor or a module missing one."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        split = split_wire_name(name)
        if split is None:
            raise KeyError(f"{where}: {name!r} is not an adapter factor")
        factors.setdefault(split[0], {})[split[1]] = tensor
    for module, found in factors.items():
        if set(found) != {LORA_A, LORA_B}:
            missing = LORA_B if LORA_A in found else LORA_A
            raise ValueError(f"{where}: {wire_name(module, missing)} is missing")
    return {module: (f[LORA_A], f[LORA_B]) for module, f in factors.items()}


def adapter_factors(buckets: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, s·B) of one adapter sync's buckets (rollout/weight_bucket.py), each
    buffer checked against its specs and no tensor sent twice, before any is read."""
    from rollout.weight_bucket import check_buckets, iter_tensors

    check_buckets(buckets, {s.name: s.shape for bucket in buckets for s in bucket.specs})
    return group_factors(iter_tensors(buckets), "adapter sync")
