"""The policy's token_stats verb on real gloo process groups (no Ray): log π_T and H(π_T)
of every response token, gathered from DP ranks' micro-batches and CP shards (packed rows,
padded, and packed rows sharing a group's prompt), equal the float64 values transformers
and torch's softmax give on the same ids, and are 0 off the loss mask (a multi-turn
observation's hole included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout.batch import RolloutBatch
from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.trainer.helpers import sampled_train_batch
from trainer.config import ObjectiveConfig, TrainerConfig

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def batch(tiny_model: str) -> RolloutBatch:
    """A sampled batch whose sample 1 has an observation (loss mask 0) mid-response."""
    sampled = sampled_train_batch(tiny_model, temperature=TEMPERATURE)
    mask = sampled.loss_mask.clone()
    start = int(sampled.prompt_lengths[1])
    mask[1, start + 2:start + 4] = 0.0
    return dataclasses.replace(sampled, loss_mask=mask)


def reference(model_path: str, batch: RolloutBatch, temperature: float = TEMPERATURE
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """log π_T(token) and H(π_T) [N, S] in float64, each sample alone (no padding): the
    logits at t − 1 give token t's; softmax(z / T) and −Σ p log p written out."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float64).eval()
    log_probs = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    entropy = torch.zeros_like(log_probs)
    for i, length in enumerate(batch.sequence_lengths.tolist()):
        ids = batch.input_ids[i, :length]
        with torch.no_grad():
            logits = model(ids[None]).logits[0, :-1].double() / temperature
        p = torch.softmax(logits, dim=-1)
        log_probs[i, 1:length] = torch.log(p.gather(-1, ids[1:, None]).squeeze(-1))
        entropy[i, 1:length] = -(p * torch.log(p)).sum(dim=-1)
    keep = batch.loss_mask > 0
    return log_probs * keep, entropy * keep


def _token_stats(rank: int, port: int, model_path: str, batch: RolloutBatch, dp: int, cp: int,
                 packed: bool, shared: bool):
    from trainer.backends.fsdp.worker import FSDPWorker
    from trainer.step_plan import plan_step

    max_tokens = 40 if shared else 24  # a row holds two samples of a group: one prompt
    config = TrainerConfig(dp_size=dp, cp_size=cp, max_tokens_per_micro_batch=max_tokens,
                           packing=packed, shared_prefix=shared)
    objective = ObjectiveConfig(temperature=TEMPERATURE)
    worker = FSDPWorker(config, objective, model_path, rank, total_steps=1)
    worker.setup("127.0.0.1", port)
    plan = plan_step(batch, objective, dp, cp, max_tokens_per_micro_batch=max_tokens,
                     packed=packed, shared_prefix=shared)
    assert len(plan.micro_batches[0]) > 1  # several micro-batches (rows) per rank
    assert (plan.prefix_skip is not None) == shared  # a group's prompt computed once
    stats = worker.token_stats(batch, plan)
    log_probs = worker.log_probs(batch, plan)
    return stats, log_probs


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "cp", "packed", "shared"), [
    (2, 1, True, False), (1, 2, True, False), (1, 2, False, False), (2, 1, True, True)])
def test_token_stats_equal_the_float64_reference_under_dp_cp_and_packing(
        tiny_model: str, batch: RolloutBatch, dp: int, cp: int, packed: bool,
        shared: bool) -> None:
    (log_probs, entropy), old = run_ranks(_token_stats, 2, tiny_model, batch, dp, cp,
                                          packed, shared)[0]
    want_log_probs, want_entropy = reference(tiny_model, batch)
    keep = batch.loss_mask > 0
    assert not keep[1].all() and keep[1].sum() > 0  # the hole is inside a response
    torch.testing.assert_close(log_probs.double(), want_log_probs, rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=2e-5)
    assert (log_probs[~keep] == 0).all() and (entropy[~keep] == 0).all()
    assert (entropy[keep] > 0).all()
    torch.testing.assert_close(log_probs, old, rtol=0, atol=0)  # the log_probs verb's
    # Why the reference discriminates: H at T = 1 is not H at T = 0.7 (by ≫ the tolerance).
    assert (want_entropy[keep] - reference(tiny_model, batch, 1.0)[1][keep]).abs().max() > 1e-2

