"""Megatron's vocab-parallel log-probs and entropy (trainer/backends/megatron/loss.py) at
TP 2 and TP 3 in float64 on gloo ranks: values and gradients equal the full-vocabulary
ones to 1e-10, with real tokens (and −inf logits) on every TP rank — the entropy gradient
was off by up to 0.24 at TP 2 while the tests' vocabulary left TP rank 1 all padding."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from trainer.backends.megatron.model import ModelShape
from trainer.losses import log_probs_and_entropy

pytest.importorskip("megatron.core")

VOCAB = {2: 200, 3: 700}
"""TP size → a vocabulary whose padding (to a multiple of 128·TP) leaves real ids on the
last rank: TP 2 pads 200 to 256 (rank 1: ids 128..199 real), TP 3 pads 700 to 768
(rank 2: ids 512..699 real)."""
TEMPERATURE = 0.7


def _shape(tp: int) -> ModelShape:
    multiple = 128 * tp
    padded = -(-VOCAB[tp] // multiple) * multiple
    return ModelShape(num_layers=1, hidden_size=8, ffn_hidden_size=8, num_heads=tp,
                      num_kv_heads=tp, head_dim=8, vocab_size=VOCAB[tp],
                      padded_vocab_size=padded, tied_embeddings=False, qkv_bias=False,
                      tp_size=tp)


def _case(tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared float64 logits [2, 6, padded V] (some −inf on every rank) and targets."""
    shape = _shape(tp)
    gen = torch.Generator().manual_seed(tp)
    full = torch.randn(2, 6, shape.padded_vocab_size, generator=gen, dtype=torch.float64) * 3
    for rank in range(tp):  # blocked tokens inside every rank's real columns
        start = rank * shape.vocab_per_rank
        full[1, :, start + 3: start + 40] = -torch.inf
    full[0, 1, : shape.vocab_size - 1] = -torch.inf  # one finite logit left in the row
    targets = torch.randint(0, shape.vocab_size, (2, 6), generator=gen)
    targets[0, 1] = shape.vocab_size - 1
    targets[0, 2:2 + tp] = torch.tensor([r * shape.vocab_per_rank + 1 for r in range(tp)])
    return full, targets


def _vocab_parallel(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    from trainer.backends.megatron.loss import vocab_parallel_log_probs

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size,
                                 create_gloo_process_groups=False)
    try:
        shape = _shape(world_size)
        full, targets = _case(world_size)
        start = rank * shape.vocab_per_rank
        local = full[..., start: start + shape.vocab_per_rank].clone().requires_grad_(True)
        log_probs, entropy = vocab_parallel_log_probs(local, targets, shape, TEMPERATURE,
                                                      entropy=True)
        (log_prob_grad,) = torch.autograd.grad(log_probs.sum(), local, retain_graph=True)
        (entropy_grad,) = torch.autograd.grad(entropy.sum(), local)
        return {"log_probs": log_probs.detach(), "entropy": entropy.detach(),
                "log_prob_grad": log_prob_grad, "entropy_grad": entropy_grad}
    finally:
        ps.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_parallel_terms_and_gradients_equal_the_full_vocabulary_in_float64(tp: int
                                                                                ) -> None:
    ranks = run_distributed(_vocab_parallel, tp)
    shape = _shape(tp)
    full, targets = _case(tp)
    real = full[..., : shape.vocab_size].clone().requires_grad_(True)
    log_probs, entropy = log_probs_and_entropy(real, targets, TEMPERATURE,
                                               with_entropy_grad=True)
    (log_prob_grad,) = torch.autograd.grad(log_probs.sum(), real, retain_graph=True)
    (entropy_grad,) = torch.autograd.grad(entropy.sum(), real)
    for got in ranks:  # every TP rank computes the same per-position values
        assert torch.allclose(got["log_probs"], log_probs.detach(), rtol=0, atol=1e-10)
        assert torch.allclose(got["entropy"], entropy.detach(), rtol=0, atol=1e-10)
    for name, expected in (("log_prob_grad", log_prob_grad), ("entropy_grad", entropy_grad)):
        grads = torch.cat([r[name] for r in ranks], dim=-1)
        assert torch.isfinite(grads).all(), name
        assert (grads[..., shape.vocab_size:] == 0).all(), name  # padding gets nothing
        torch.testing.assert_close(grads[..., : shape.vocab_size], expected, rtol=0,
                                   atol=1e-10, msg=name)
    assert entropy[0, 1].abs() < 1e-12  # one token left: H = 0, not NaN
