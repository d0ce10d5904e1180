"""HF <-> Megatron weight conversion: exact round trips at every TP size, and the layout
checks of model_shape. Pure tensor code: megatron-core is not needed here."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from trainer.backends.megatron.convert import hf_to_megatron, megatron_to_hf, rules
from trainer.backends.megatron.model import model_shape

ARCH = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "max_position_embeddings": 64}
# Vocabularies with real ids on every TP rank tested: Megatron pads to a multiple of
# 128·TP, so 200 spans TP=2 (rank 1 from 128) and 400 spans TP=2 and TP=4 (rank 3 from 384).


def _qwen2_tied() -> Qwen2Config:
    return Qwen2Config(vocab_size=200, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=True, **ARCH)


def _llama_untied() -> LlamaConfig:
    return LlamaConfig(vocab_size=400, num_attention_heads=8, num_key_value_heads=4,
                       tie_word_embeddings=False, **ARCH)


def _random_state(config: object) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return {k: torch.randn_like(v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("make_config", "tp_size"), [
    (_qwen2_tied, 1), (_qwen2_tied, 2), (_llama_untied, 1), (_llama_untied, 2),
    (_llama_untied, 4)])
def test_round_trip_is_exact(make_config, tp_size: int) -> None:
    config = make_config()
    hf = _random_state(config)
    if config.tie_word_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    shape = model_shape(config, tp_size)
    shards = [hf_to_megatron(hf, shape, rank) for rank in range(tp_size)]
    assert set(shards[0]) == {r.megatron for r in rules(shape)}
    vocab = shards[0]["embedding.word_embeddings.weight"]
    assert vocab.shape[0] * tp_size == shape.padded_vocab_size
    assert shape.padded_vocab_size % (128 * tp_size) == 0
    assert config.vocab_size > (tp_size - 1) * shape.vocab_per_rank  # real ids on the last rank
    back = megatron_to_hf(shards, shape)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_is_fused_per_query_group() -> None:
    """Rank 0 of TP=2 holds query group 0: its 2 q heads, then its k head, then its v."""
    config = _qwen2_tied()
    hf = _random_state(config)
    shape = model_shape(config, 2)
    qkv = hf_to_megatron(hf, shape, 0)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    d = shape.head_dim
    assert torch.equal(qkv, torch.cat([q[: 2 * d], k[:d], v[:d]]))


def test_gate_and_up_are_split_separately() -> None:
    config = _llama_untied()
    hf = _random_state(config)
    fc1 = hf_to_megatron(hf, model_shape(config, 2), 1)["decoder.layers.1.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[48:], up[48:]]))


def test_model_shape_refuses_what_it_cannot_reproduce() -> None:
    with pytest.raises(ValueError, match="tp_size"):
        model_shape(_qwen2_tied(), 4)  # 2 key/value heads cannot split 4 ways
    with pytest.raises(NotImplementedError, match="attention_bias"):
        model_shape(LlamaConfig(attention_bias=True, **ARCH), 1)
    with pytest.raises(NotImplementedError, match="model_type"):
        model_shape(type("Cfg", (), {"model_type": "gpt2"})(), 1)
