from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.distributed import run_distributed
from trainer.context_parallel import zigzag_positions, zigzag_shard, zigzag_unshard
from trainer.cp_attention import context_parallel, enable_context_parallel

SEQ_LENS = (13, 9, 6)  # right-padded to 13; CP=2 pads again to 16


def _tiny_model(attn_implementation: str = "sdpa") -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=40,
        max_position_embeddings=64,
        # Larger than the default 0.02 so attention is far from uniform and a wrong mask shows.
        initializer_range=0.2,
        attn_implementation=attn_implementation,
    )
    return Qwen2ForCausalLM(config).float()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids, next-token labels and label mask [B, S]; labels are shifted on the full rows."""
    gen = torch.Generator().manual_seed(1)
    seq_len = max(SEQ_LENS)
    ids = torch.zeros(len(SEQ_LENS), seq_len, dtype=torch.long)
    mask = torch.zeros(len(SEQ_LENS), seq_len)
    for row, length in enumerate(SEQ_LENS):
        ids[row, :length] = torch.randint(1, 40, (length,), generator=gen)
        mask[row, : length - 1] = 1.0
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    return ids, labels, mask


def _loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ over tokens of −log p(label): a sum, so the ranks' losses add up to the full one."""
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    return -(logp * mask).sum()


def _cp_worker(rank: int, world_size: int, state_dict: dict) -> dict:
    torch.set_num_threads(1)
    model = _tiny_model()
    model.load_state_dict(state_dict)
    enable_context_parallel(model)
    ids, labels, mask = _batch()
    ids_s, labels_s, mask_s = (
        zigzag_shard(t, world_size, rank, dim=1) for t in (ids, labels, mask)
    )
    positions = zigzag_positions(ids.shape[1], world_size, rank).expand(ids.shape[0], -1)
    with context_parallel(dist.group.WORLD, positions):
        logits = model(input_ids=ids_s, position_ids=positions, use_cache=False).logits
    # Backward outside the block: the gather's backward keeps its own group.
    _loss(logits, labels_s, mask_s).backward()
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)
        grads[name] = param.grad
    return {"logits": logits.detach(), "grads": grads}


@pytest.mark.slow
def test_cp2_matches_full_sequence_logits_and_grads() -> None:
    reference = _tiny_model()
    ids, labels, mask = _batch()
    ref_logits = reference(input_ids=ids, use_cache=False).logits
    _loss(ref_logits, labels, mask).backward()

    results = run_distributed(_cp_worker, 2, reference.state_dict())

    logits = zigzag_unshard([r["logits"] for r in results], ids.shape[1], dim=1)
    for row, length in enumerate(SEQ_LENS):
        torch.testing.assert_close(
            logits[row, :length], ref_logits[row, :length].detach(), rtol=1e-4, atol=1e-5
        )
    for rank_result in results:
        for name, param in reference.named_parameters():
            torch.testing.assert_close(
                rank_result["grads"][name], param.grad, rtol=1e-4, atol=1e-5, msg=name
            )


@torch.no_grad()
def test_without_context_is_ordinary_causal_attention() -> None:
    reference, model = _tiny_model(), _tiny_model()
    enable_context_parallel(model)
    ids, _, _ = _batch()
    expected = reference(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, expected)
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    torch.testing.assert_close(
        model(input_ids=ids, position_ids=positions, use_cache=False).logits, expected
    )
    # Two new tokens after a KV cache: the keys are the whole prefix, still causal among the new.
    prefix = model(input_ids=ids[:, :-2], use_cache=True)
    step = model(input_ids=ids[:, -2:], cache=prefix.cache, use_cache=True).logits
    torch.testing.assert_close(step, expected[:, -2:])
