"""The colocated fast path (verl's hybrid engine): a torch engine inside a trainer rank's
process that generates from the rank's own parameters.

    separate engine:  rank 0 packs buckets ─► object store ─► engine actor copies them
    colocated:        stage(v): every rank gathers each tensor once ──► staged[v]
                      serve(v): in the manager's order, the serving model takes staged[v]

Two ways to hold the weights, chosen by the driver:

- **alias** (one rank, the engine's dtype is the trainer's, ``rollout.async_steps: 0``):
  the serving model's tensors *are* the rank's parameters, so nothing is copied, ever.
  Exact because a synchronous rollout is generated between two optimizer steps, when the
  parameters are those of the version the rollout asks for.
- **copy** (several ranks, another dtype, or the async pipeline, where rollout s + 1 may
  run while step s trains): ``stage`` gathers the full tensors into a new set kept for
  version v, ``serve`` swaps them in (no second copy). What is served is always a whole
  version, the one the manager's queue reached, as with a separate engine
  (services/driver/pipeline.py).

The decode loop is the torch engine's own (rollout/engines/torch_engine.py), so the
log-prob convention, stop rules and seeds are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.base import Generation
from rollout.engines.torch_engine import TorchEngine


def serving_model(model_path: str, dtype: torch.dtype, device: torch.device
                  ) -> torch.nn.Module:
    """An empty HF model of ``model_path``'s architecture (no weights read: they come
    from the trainer), with the checkpoint's generation config (its EOS ids)."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives a tied head a tensor of its own
    with contextlib.suppress(OSError):  # no generation_config.json: the config's ids stand
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    return model.eval().requires_grad_(False)


class ColocatedEngine:
    """One rank's engine: the torch decode loop over a model fed from the trainer."""

    def __init__(self, config: TorchEngineConfig, model_path: str, tokenizer_path: str | None,
                 rank: int, device: torch.device, alias: bool) -> None:
        self.alias, self.dtype = alias, getattr(torch, config.dtype)
        self.model = serving_model(model_path, self.dtype, device)
        self.tensors = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        self.engine = TorchEngine(config, model_path, tokenizer_path, rank, model=self.model)
        self.staged: dict[int, dict[str, torch.Tensor]] = {}
        self.weight_version = -1  # nothing served until the first serve

    def check_names(self, names: list[str]) -> None:
        """The trainer holds exactly the tensors the serving model needs."""
        if set(names) != set(self.tensors):
            missing, extra = set(self.tensors) - set(names), set(names) - set(self.tensors)
            raise ValueError(f"colocated engine: the trainer's tensors differ from the "
                             f"model's (missing {sorted(missing)[:3]}, "
                             f"extra {sorted(extra)[:3]})")

    def stage(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Keep weights ``version`` (every full tensor by name, as the trainer yields them)
        to serve later; the bytes copied (0 when aliased: the trainer's own storage)."""
        copied, staged = 0, {}
        for name, full in tensors:
            own = self.tensors[name]
            if self.alias:
                if full.dtype != own.dtype or full.shape != own.shape:
                    raise ValueError(f"colocated engine: {name} cannot be aliased "
                                     f"({full.dtype} {tuple(full.shape)} for {own.dtype} "
                                     f"{tuple(own.shape)})")
                staged[name] = full
            else:
                staged[name] = full.to(own.device, own.dtype, copy=True)
                copied += staged[name].numel() * staged[name].element_size()
        self.staged[version] = staged
        return copied

    @torch.no_grad()
    def serve(self, version: int) -> None:
        """Serve the weights staged as ``version`` (older staged versions are dropped)."""
        if version not in self.staged:
            raise KeyError(f"colocated engine: weights {version} were never staged "
                           f"(staged: {sorted(self.staged)})")
        staged = self.staged.pop(version)
        for name, tensor in staged.items():
            self.tensors[name].data = tensor  # a swap of storage, not a copy
        self.staged = {v: s for v, s in self.staged.items() if v > version}
        self.weight_version = self.engine.weight_version = version

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int
                 ) -> list[Generation]:
        return self.engine.generate(prompt_ids, sampling, seed)
