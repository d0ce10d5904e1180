r"""Hugging Face <-> megatron-core weights for Qwen2 / Llama, at any TP size, exactly.

Each Megatron parameter is made from one or more HF tensors by one rule:

    replicated  norms: the same tensor on every TP rank
    cols        row-parallel weight (o_proj, down_proj): split along dim 1
    vocab       embeddings / lm_head: rows padded with zeros to padded_vocab_size, split
    qkv         q, k, v fused per query group g and split over groups:
                [q_g (heads·d) ; k_g (d) ; v_g (d)] for g = 0..G−1, rank r keeps G/TP groups
    gate_up     gate and up split separately, rank r keeps [gate_r ; up_r]

Every rule is a pure re-indexing (no arithmetic), so HF -> Megatron -> HF reproduces the
original tensors bit for bit. Tied embeddings have no ``output_layer``; the exported HF
dict still carries ``lm_head.weight`` (a copy of the embeddings), like ``state_dict()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trainer.backends.megatron.model import ModelShape

Kind = Literal["replicated", "cols", "vocab", "qkv", "gate_up"]
HF_TIED_HEAD, HF_EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"
# TransformerEngine's layer spec fuses the pre-norms into the next linear layer.
TE_NORM_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    kind: Kind


def rules(shape: ModelShape, fused_norms: bool = False) -> list[Rule]:
    """Every Megatron parameter of the model and the HF tensors it is made of."""
    out = [Rule("embedding.word_embeddings.weight", (HF_EMBEDDINGS,), "vocab")]
    for i in range(shape.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = [f"{hf}self_attn.{p}_proj" for p in "qkv"]
        norm = {k: mg + (TE_NORM_NAMES[k] if fused_norms else k) for k in TE_NORM_NAMES}
        out += [
            Rule(norm["input_layernorm.weight"], (f"{hf}input_layernorm.weight",), "replicated"),
            Rule(f"{mg}self_attention.linear_qkv.weight", tuple(f"{a}.weight" for a in attn),
                 "qkv"),
            Rule(f"{mg}self_attention.linear_proj.weight", (f"{hf}self_attn.o_proj.weight",),
                 "cols"),
            Rule(norm["pre_mlp_layernorm.weight"], (f"{hf}post_attention_layernorm.weight",),
                 "replicated"),
            Rule(f"{mg}mlp.linear_fc1.weight",
                 (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"), "gate_up"),
            Rule(f"{mg}mlp.linear_fc2.weight", (f"{hf}mlp.down_proj.weight",), "cols"),
        ]
        if shape.qkv_bias:
            out.append(Rule(f"{mg}self_attention.linear_qkv.bias",
                            tuple(f"{a}.bias" for a in attn), "qkv"))
    out.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not shape.tied_embeddings:
        out.append(Rule("output_layer.weight", (HF_TIED_HEAD,), "vocab"))
    return out


def _qkv_groups(shape: ModelShape, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
    """[G, (heads_per_group + 2)·d, *rest]: each query group's q heads, then its k and v."""
    groups, rest = shape.num_kv_heads, q.shape[1:]
    per_group = shape.num_heads // groups * shape.head_dim
    return torch.cat([q.reshape(groups, per_group, *rest),
                      k.reshape(groups, shape.head_dim, *rest),
                      v.reshape(groups, shape.head_dim, *rest)], dim=1)


def shard(rule: Rule, tensors: list[torch.Tensor], shape: ModelShape,
          tp_rank: int) -> torch.Tensor:
    """The slice of a Megatron parameter TP rank ``tp_rank`` holds, from its HF tensors."""
    tp = shape.tp_size
    if rule.kind == "replicated":
        return tensors[0]
    if rule.kind == "cols":
        return tensors[0].chunk(tp, dim=1)[tp_rank]
    if rule.kind == "vocab":
        (table,) = tensors
        padded = table.new_zeros((shape.padded_vocab_size, *table.shape[1:]))
        padded[: table.shape[0]] = table
        return padded.chunk(tp, dim=0)[tp_rank]
    if rule.kind == "qkv":
        fused = _qkv_groups(shape, *tensors).chunk(tp, dim=0)[tp_rank]
        return fused.reshape(-1, *tensors[0].shape[1:])
    if rule.kind == "gate_up":
        gate, up = (t.chunk(tp, dim=0)[tp_rank] for t in tensors)
        return torch.cat([gate, up], dim=0)
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def merge(rule: Rule, shards: list[torch.Tensor], shape: ModelShape) -> list[torch.Tensor]:
    """Inverse of :func:`shard`: the HF tensors from every TP rank's slice, in rank order."""
    if rule.kind == "replicated":
        return [shards[0]]
    if rule.kind == "cols":
        return [torch.cat(shards, dim=1)]
    if rule.kind == "vocab":
        return [torch.cat(shards, dim=0)[: shape.vocab_size]]
    if rule.kind == "qkv":
        rest = shards[0].shape[1:]
        per_group = shape.num_heads // shape.num_kv_heads * shape.head_dim
        fused = torch.cat(shards, dim=0).reshape(shape.num_kv_heads, -1, *rest)
        q, k, v = fused.split([per_group, shape.head_dim, shape.head_dim], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    if rule.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def hf_to_megatron(hf_state: dict[str, torch.Tensor], shape: ModelShape, tp_rank: int,
                   fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s Megatron tensors for every rule whose HF tensors are present
    (so a caller may convert one layer at a time)."""
    return {rule.megatron: shard(rule, [hf_state[n] for n in rule.hf], shape, tp_rank)
            for rule in rules(shape, fused_norms) if all(n in hf_state for n in rule.hf)}


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], shape: ModelShape,
                   fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """HF tensors from every TP rank's Megatron tensors (``shards[tp_rank]``)."""
    out: dict[str, torch.Tensor] = {}
    for rule in rules(shape, fused_norms):
        if rule.megatron in shards[0]:
            tensors = merge(rule, [s[rule.megatron] for s in shards], shape)
            out.update(zip(rule.hf, (t.contiguous() for t in tensors), strict=True))
    if shape.tied_embeddings and HF_EMBEDDINGS in out:
        out[HF_TIED_HEAD] = out[HF_EMBEDDINGS].clone()
    return out
