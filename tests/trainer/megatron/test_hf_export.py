"""Real gloo processes, TP=2 on CPU: megatron-core's GPTModel built from a HF config and
loaded from HF safetensors gives the HF model's logits; its weights exported back to a
HF folder load with ``from_pretrained`` and give the same logits again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.distributed import run_distributed
from tests.trainer.megatron.helpers import create_wide_vocab_checkpoint

pytest.importorskip("megatron.core")

TOKENS = torch.tensor([[5, 17, 42, 9, 33, 61, 2, 88, 14, 130],
                       [3, 8, 99, 21, 54, 149, 16, 40, 11, 6]])
"""Ids on both TP ranks' embedding slices (rank 1 holds 128..255 at TP=2); both models'
vocabularies (200 and 150) span both ranks, so their logits do too."""


def _megatron_logits_and_export(rank: int, world_size: int, model_dirs: list[str],
                                export_root: str) -> list[torch.Tensor]:
    """Per model: perturb the loaded weights (same HF noise on every rank), return the
    full-vocabulary logits and write the exported weights as a HF folder."""
    from megatron.core import parallel_state as ps

    from trainer.backends.megatron.convert import hf_to_megatron
    from trainer.backends.megatron.cpu_bridge import cpu_bridge, install_rng_tracker
    from trainer.backends.megatron.model import build_gpt_model, model_shape
    from trainer.backends.megatron.weights import WeightMover
    from trainer.checkpoint import save_hf_model

    cpu = torch.device("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size,
                                 create_gloo_process_groups=False)
    install_rng_tracker(0, cpu)
    results = []
    try:
        for i, model_dir in enumerate(model_dirs):
            config = AutoConfig.from_pretrained(model_dir)
            shape = model_shape(config, world_size)
            with cpu_bridge(cpu):
                model = build_gpt_model(config, shape, 1, torch.float32, cpu)
            weights = WeightMover(model, shape, cpu)
            weights.read_checkpoint(model_dir)
            gen = torch.Generator().manual_seed(i)
            reference = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
            noise = {k: 0.02 * torch.randn(v.shape, generator=gen) for k, v in reference.items()}
            tp_rank = ps.get_tensor_model_parallel_rank()
            with torch.no_grad():
                for name, delta in hf_to_megatron(noise, shape, tp_rank).items():
                    weights.params[name].add_(delta)
            with cpu_bridge(cpu), torch.no_grad():
                local = model(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS), None)
            parts = [torch.empty_like(local) for _ in range(world_size)]
            torch.distributed.all_gather(parts, local.contiguous())
            results.append(torch.cat(parts, dim=-1)[..., : config.vocab_size])
            state = weights.export()
            if rank == 0:
                save_hf_model(Path(export_root) / str(i), model_dir, config, state)
            torch.distributed.barrier()
    finally:
        ps.destroy_model_parallel()
    return results


def _untied_llama(path: Path) -> str:
    config = LlamaConfig(vocab_size=150, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


@pytest.mark.slow
def test_tp2_logits_and_hf_export_match_transformers(tmp_path: Path) -> None:
    model_dirs = [create_wide_vocab_checkpoint(tmp_path / "qwen2", seed=0),
                  _untied_llama(tmp_path / "llama")]
    megatron_logits = run_distributed(_megatron_logits_and_export, 2, model_dirs,
                                      str(tmp_path / "export"))[0]
    for i, logits in enumerate(megatron_logits):
        exported, info = AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "export" / str(i)), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        with torch.no_grad():
            hf_logits = exported(TOKENS).logits
        assert (logits - hf_logits).abs().max() < 1e-4, model_dirs[i]
