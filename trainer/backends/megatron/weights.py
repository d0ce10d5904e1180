"""Whole Hugging Face state dicts in and out of a TP-sharded Megatron model (collective).

Weights (and optimizer moments) travel with HF names: into the model as a broadcast from
global rank 0 followed by each rank cutting its TP slice (``convert.shard``), out of it
as an all-gather over the TP group of the first DP×CP replica followed by
``convert.megatron_to_hf`` on global rank 0. Every DP×CP replica holds the same weights,
so the other replicas have nothing to send. Tensors move one Megatron parameter at a
time, so no rank holds more than one layer's worth of extra copies.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from trainer.backends.megatron.convert import Rule, megatron_to_hf, rules, shard
from trainer.backends.megatron.model import ModelShape


def checkpoint_reader(model_path: str) -> Callable[[str], torch.Tensor]:
    """name -> tensor from a HF folder's safetensors (single file or sharded index)."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")

    def read(name: str) -> torch.Tensor:
        if name not in weight_map:
            raise KeyError(f"{model_path}: the checkpoint has no tensor {name!r}")
        with safe_open(str(folder / weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)

    return read


class WeightMover:
    """Named access to one rank's Megatron parameters, in HF terms."""

    def __init__(self, model: torch.nn.Module, shape: ModelShape, device: torch.device,
                 params: dict[str, torch.Tensor] | None = None) -> None:
        """``params``: the tensors it reads and writes, by the model's Megatron names (the
        worker passes its fp32 main params); the model's own parameters by default."""
        from megatron.core import parallel_state as ps

        self.shape, self.device = shape, device
        self.params = params if params is not None else dict(model.named_parameters())
        fused_norms = any(n.endswith("layer_norm_weight") for n in self.params)
        self.rules = rules(shape, fused_norms)
        self.fused_norms = fused_norms
        missing = set(self.params) - {r.megatron for r in self.rules}
        if missing:
            raise NotImplementedError(f"no HF mapping for Megatron parameters {sorted(missing)}")
        self.tp_sharded = {r.megatron: r.kind != "replicated" for r in self.rules}
        """Whether a parameter is split over TP ranks (else every TP rank holds a copy)."""
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.gathers = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        self.is_root = dist.get_rank() == 0

    @torch.no_grad()
    def read_checkpoint(self, model_path: str) -> None:
        """Every rank reads its own slices from the checkpoint folder (no collective)."""
        read = checkpoint_reader(model_path)
        for rule in self.rules:
            self.params[rule.megatron].copy_(
                shard(rule, [read(n) for n in rule.hf], self.shape, self.tp_rank))

    def scatter(self, hf_state: dict[str, torch.Tensor] | None
                ) -> Iterator[tuple[Rule, torch.Tensor]]:
        """Collective: rank 0 passes HF tensors, every rank gets its slice of each rule
        whose HF tensors rank 0 has (tied models ignore ``lm_head.weight``)."""
        meta = [{n: (tuple(t.shape), t.dtype) for n, t in (hf_state or {}).items()}]
        dist.broadcast_object_list(meta, src=0)
        for rule in self.rules:
            if not all(n in meta[0] for n in rule.hf):
                continue
            tensors = []
            for name in rule.hf:
                shape, dtype = meta[0][name]
                tensor = (hf_state[name].to(self.device, copy=True) if self.is_root
                          else torch.empty(shape, dtype=dtype, device=self.device))
                dist.broadcast(tensor, src=0)
                tensors.append(tensor)
            yield rule, shard(rule, tensors, self.shape, self.tp_rank)

    @torch.no_grad()
    def load(self, hf_state: dict[str, torch.Tensor] | None) -> None:
        """Collective: rank 0's full HF state dict replaces the weights on every rank."""
        loaded = set()
        for rule, tensor in self.scatter(hf_state):
            self.params[rule.megatron].copy_(tensor)
            loaded.add(rule.megatron)
        if loaded != set(self.params):
            missing = sorted(set(self.params) - loaded)
            raise KeyError(f"load_weights: no HF tensors for Megatron parameters {missing}")

    def gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Collective over the first replica's TP group: Megatron-named slices (parameters
        or anything shaped like them) -> HF tensors on CPU at global rank 0, else None."""
        if not self.gathers:
            return None
        per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(self.shape.tp_size)]
        for rule in self.rules:
            if rule.megatron not in tensors:
                continue
            local = tensors[rule.megatron].detach().contiguous()
            parts = [local.clone()]  # never alias live parameters
            if self.shape.tp_size > 1:
                parts = [torch.empty_like(local) for _ in range(self.shape.tp_size)]
                dist.all_gather(parts, local, group=self.tp_group)
            if self.is_root:
                for rank, part in enumerate(parts):
                    per_rank[rank][rule.megatron] = part.cpu()
        return megatron_to_hf(per_rank, self.shape, self.fused_norms) if self.is_root else None

    def export(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full HF state dict at global rank 0, None elsewhere."""
        return self.gather(self.params)
