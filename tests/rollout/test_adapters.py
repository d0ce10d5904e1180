"""LoRA adapters on a torch engine (rollout/adapters.py): the engine computes the adapted
model's logits unmerged, swaps versions whole, and refuses a bad version before any
factor changes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.adapters import (
    LORA_A,
    LORA_B,
    read_peft_folder,
    wire_name,
    write_peft_folder,
)
from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.torch_engine import TorchEngine
from rollout.weight_bucket import pack_bucket, plan_buckets

IDS = torch.tensor([[1, 70, 84, 4, 69, 70, 33, 40]])


def _factors(model: torch.nn.Module, seed: int, rank: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "down_proj")):
            tensors[wire_name(name, LORA_A)] = 0.3 * torch.randn(
                rank, module.in_features, generator=gen)
            tensors[wire_name(name, LORA_B)] = 0.3 * torch.randn(
                module.out_features, rank, generator=gen)
    return tensors


def _buckets(tensors: dict[str, torch.Tensor]) -> list:
    specs = plan_buckets([(n, tuple(t.shape)) for n, t in tensors.items()], "float32", 4096)
    return [pack_bucket(s, tensors) for s in specs]


def _merged_logits(model_path: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference: W + B·A written into the weights of a plain model."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, a in tensors.items():
            if name.endswith(LORA_A):
                module = name.removesuffix(f".{LORA_A}")
                modules[module].weight += tensors[wire_name(module, LORA_B)] @ a
        return model(input_ids=IDS).logits


def _logits(engine: TorchEngine) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(input_ids=IDS).logits


def test_engine_adds_the_low_rank_term_and_swaps_versions_whole(tiny_model_path: str
                                                                ) -> None:
    engine = TorchEngine(TorchEngineConfig(batch_size=4), tiny_model_path)
    base = _logits(engine)
    first, second = _factors(engine.model, 0), _factors(engine.model, 1)
    engine.load_weight_buckets(_buckets(first), version=1)
    torch.testing.assert_close(_logits(engine), _merged_logits(tiny_model_path, first),
                               rtol=1e-4, atol=1e-4)
    assert (_logits(engine) - base).abs().max() > 1e-2
    engine.load_weight_buckets(_buckets(second), version=2)
    served = _logits(engine)
    torch.testing.assert_close(served, _merged_logits(tiny_model_path, second),
                               rtol=1e-4, atol=1e-4)
    assert engine.weight_version == 2
    sampled = engine.generate([[1, 70, 84]] * 2, SamplingConfig(max_new_tokens=4), seed=0)
    assert all(len(g.token_ids) for g in sampled)

    # A bad version is refused whole: version 2 keeps serving, bit for bit.
    missing_b = {k: v for k, v in first.items() if not k.endswith(LORA_B)}
    wrong_shape = {**first, next(iter(first)): torch.zeros(3, 7)}
    unknown = {**first, "model.layers.0.nope.lora_A": torch.zeros(3, 8),
               "model.layers.0.nope.lora_B": torch.zeros(8, 3)}
    mixed = {**first, "model.norm.weight": torch.ones(engine.model.config.hidden_size)}
    for bad, said in ((missing_b, "lora_B is missing"), (wrong_shape, "do not fit"),
                      (unknown, "no Linear"), (mixed, "whole weight in a sync of adapters")):
        with pytest.raises((KeyError, ValueError), match=said):
            engine.load_weight_buckets(_buckets(bad), version=3)
        assert torch.equal(_logits(engine), served) and engine.weight_version == 2


def test_peft_folder_round_trip_and_peft_reads_it(tiny_model_path: str, tmp_path) -> None:
    """write_peft_folder's folder is what peft writes: PeftModel.from_pretrained applies
    it to the base as the engine does (scaling alpha / r)."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tensors = _factors(model, 2, rank=4)
    factors = {name.removesuffix(f".{LORA_A}"): (a, tensors[wire_name(
        name.removesuffix(f".{LORA_A}"), LORA_B)]) for name, a in tensors.items()
        if name.endswith(LORA_A)}
    folder = write_peft_folder(tmp_path / "adapter", factors, rank=4, alpha=8.0,
                               base_model_path=tiny_model_path)
    config, read = read_peft_folder(folder)
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == ["down_proj", "q_proj"]
    for module, (a, b) in factors.items():
        assert torch.equal(read[module][0], a) and torch.equal(read[module][1], b)
    adapted = PeftModel.from_pretrained(model, str(folder))
    scaled = {**tensors, **{wire_name(m, LORA_B): 2.0 * b for m, (_, b) in factors.items()}}
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=IDS).logits,
                                   _merged_logits(tiny_model_path, scaled),
                                   rtol=1e-4, atol=1e-4)
