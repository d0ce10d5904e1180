"""The Megatron backend on SmolLM2-135M-Instruct's real config and weights (Llama, 30
layers, hidden 576, 9 query heads in 3 key/value groups, tied embeddings, vocab 49152).

HF -> Megatron -> HF is bit-exact at every TP size the heads allow (1 and 3; 2 cannot
split 3 groups and is refused by name), and the shapes of the padded vocabulary and the
fused per-group QKV are those of the real config. On SmolLM2 cut to its first two
layers (real embeddings, norm and tokenizer), one SGD step of the Megatron backend
equals one step of the fsdp backend: gradients, logged terms and updated weights, and
Megatron at TP=3 (a third of the 49152-row vocabulary, of the query groups and of the MLP
on each rank) equals TP=1 (``slow``: three more gloo ranks, about 45 s on 2 cores).

The model is imported once per session (the ``smollm2_path`` fixture)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from tests.trainer.helpers import random_train_batch
from tests.trainer.megatron.equivalence import Runs, assert_same
from trainer.backends.megatron.convert import (
    HF_EMBEDDINGS,
    HF_TIED_HEAD,
    hf_to_megatron,
    megatron_to_hf,
    rules,
)
from trainer.backends.megatron.model import model_shape
from trainer.config import LossConfig, OptimizerConfig, TrainerConfig

VOCAB, HIDDEN, FFN, HEAD_DIM, NUM_HEADS, NUM_GROUPS = 49152, 576, 1536, 64, 9, 3
SHORT_LAYERS = 2
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[object, dict[str, torch.Tensor]]:
    """The real config and HF state dict; ``lm_head.weight`` shares the embeddings, as
    in the model's own ``state_dict()`` (the safetensors file stores it once)."""
    state = load_file(str(smollm2_path / WEIGHTS))
    assert HF_TIED_HEAD not in state
    state[HF_TIED_HEAD] = state[HF_EMBEDDINGS]
    return AutoConfig.from_pretrained(smollm2_path), state


def test_real_config_shape(smollm2) -> None:
    config, _ = smollm2
    for tp_size in (1, 3):
        shape = model_shape(config, tp_size)
        assert (shape.num_layers, shape.hidden_size, shape.head_dim) == (30, HIDDEN, HEAD_DIM)
        assert (shape.num_heads, shape.num_kv_heads) == (NUM_HEADS, NUM_GROUPS)
        assert shape.tied_embeddings and not shape.qkv_bias
        # 49152 = 128 · 384: a multiple of 128·TP already, so no padded rows at TP 1 or 3.
        assert shape.padded_vocab_size == VOCAB
        assert shape.vocab_per_rank == VOCAB // tp_size
        assert "output_layer.weight" not in {r.megatron for r in rules(shape)}


def test_tp2_is_refused_naming_the_heads(smollm2) -> None:
    config, _ = smollm2
    with pytest.raises(ValueError, match=r"tp_size: 2 must divide num_attention_heads \(9\) "
                                         r"and num_key_value_heads \(3\)"):
        model_shape(config, 2)


@pytest.mark.parametrize("tp_size", [1, 3])
def test_round_trip_is_exact(smollm2, tp_size: int) -> None:
    config, hf = smollm2
    shape = model_shape(config, tp_size)
    shards = [hf_to_megatron(hf, shape, rank) for rank in range(tp_size)]
    assert all(set(s) == {r.megatron for r in rules(shape)} for s in shards)
    per_group = (NUM_HEADS // NUM_GROUPS + 2) * HEAD_DIM  # 3 q heads, then k, then v
    layer = "decoder.layers.0."
    expected = {
        "embedding.word_embeddings.weight": (VOCAB // tp_size, HIDDEN),
        f"{layer}self_attention.linear_qkv.weight": (NUM_GROUPS // tp_size * per_group,
                                                     HIDDEN),
        f"{layer}self_attention.linear_proj.weight": (HIDDEN, NUM_HEADS * HEAD_DIM // tp_size),
        f"{layer}mlp.linear_fc1.weight": (2 * FFN // tp_size, HIDDEN),
        f"{layer}mlp.linear_fc2.weight": (HIDDEN, FFN // tp_size),
        f"{layer}input_layernorm.weight": (HIDDEN,),
    }
    for name, size in expected.items():
        assert all(s[name].shape == size for s in shards), name
    # Rank r holds query groups g = r·G/TP .. : each group's 3 q heads, its k head, its v.
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    q_rows = NUM_HEADS // NUM_GROUPS * HEAD_DIM
    groups_per_rank = NUM_GROUPS // tp_size
    for rank, s in enumerate(shards):
        groups = range(rank * groups_per_rank, (rank + 1) * groups_per_rank)
        assert torch.equal(s[f"{layer}self_attention.linear_qkv.weight"], torch.cat([
            torch.cat([q[g * q_rows: (g + 1) * q_rows], k[g * HEAD_DIM: (g + 1) * HEAD_DIM],
                       v[g * HEAD_DIM: (g + 1) * HEAD_DIM]]) for g in groups]))
    back = megatron_to_hf(shards, shape)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@pytest.fixture(scope="module")
def short_smollm2(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2 cut to its first ``SHORT_LAYERS`` layers: same embeddings, final norm,
    tokenizer and generation config; only ``num_hidden_layers`` changes."""
    folder = tmp_path_factory.mktemp("smollm2-short")
    for file in smollm2_path.iterdir():
        if file.name not in (WEIGHTS, "config.json"):
            shutil.copy(file, folder / file.name)
    config = json.loads((smollm2_path / "config.json").read_text())
    config["num_hidden_layers"] = SHORT_LAYERS
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    kept = [f"model.layers.{i}." for i in range(SHORT_LAYERS)]
    state = {name: tensor for name, tensor in load_file(str(smollm2_path / WEIGHTS)).items()
             if not name.startswith("model.layers.") or name.startswith(tuple(kept))}
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module")
def runs(short_smollm2: str) -> Runs:
    """SGD without clipping (a wrong gradient scale shows in the weights), ρ = 1 from the
    trainer's own log-probs (so the pg term carries a full gradient on random tokens), an
    entropy bonus over the whole real vocabulary, several micro-batches per rank."""
    config = TrainerConfig(
        optimizer=OptimizerConfig(type="sgd", lr=1.0, grad_clip=None),
        loss=LossConfig(entropy_coef=0.01),
        max_tokens_per_micro_batch=20,
    )
    batch = random_train_batch(VOCAB, num_prompts=3, group_size=2)
    return Runs(short_smollm2, batch, config, modes=("sample_mean",))


@pytest.mark.slow
def test_megatron_step_equals_fsdp_step(ray_cluster: None, runs: Runs) -> None:
    # fp32 on both sides; measured about 3e-6 relative (gradients), so 1e-4 as on tiny.
    assert_same(runs("megatron"), runs("fsdp"), tolerance=1e-4)


@pytest.mark.slow
def test_megatron_tp3_equals_tp1(ray_cluster: None, runs: Runs) -> None:
    worst = assert_same(runs("megatron", tp_size=3), runs("megatron"), tolerance=5e-5)
    print(f"TP=3 vs TP=1: {worst:.1e} relative")  # for -s
