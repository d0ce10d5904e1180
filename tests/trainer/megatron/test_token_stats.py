"""Megatron's token_stats verb on gloo processes (no Ray): log π_T and H(π_T) reduced over
the vocabulary's TP shards (``helpers.WIDE_VOCAB``: real ids on rank 1 too), or gathered
from DP ranks, equal the float64 values transformers and torch's softmax give on the
same ids (tests/trainer/fsdp/test_token_stats.py's reference), 0 off the loss mask."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed import run_ranks
from tests.trainer.fsdp.test_token_stats import TEMPERATURE, reference
from tests.trainer.helpers import sampled_train_batch
from tests.trainer.megatron.helpers import (
    create_wide_vocab_checkpoint,
    objective_for,
    start_worker,
)
from trainer.config import TrainerConfig
from trainer.step_plan import plan_step

pytest.importorskip("megatron.core")


def _token_stats(rank: int, port: int, model_path: str, batch, tp: int, dp: int):
    config = TrainerConfig(backend="megatron", tp_size=tp, dp_size=dp,
                           max_tokens_per_micro_batch=24)
    objective = objective_for(config, TEMPERATURE)
    worker = start_worker(config, objective, model_path, rank, port)
    plan = plan_step(batch, objective, dp, 1, 24)
    return worker.token_stats(batch, plan)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "dp"), [(2, 1), (1, 2)])
def test_token_stats_equal_the_float64_reference_under_tp_and_dp(
        tmp_path_factory: pytest.TempPathFactory, tp: int, dp: int) -> None:
    model_path = create_wide_vocab_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)
    sampled = sampled_train_batch(model_path, temperature=TEMPERATURE)
    mask = sampled.loss_mask.clone()
    start = int(sampled.prompt_lengths[1])
    mask[1, start + 2:start + 4] = 0.0  # an observation mid-response
    batch = dataclasses.replace(sampled, loss_mask=mask)
    log_probs, entropy = run_ranks(_token_stats, 2, model_path, batch, tp, dp)[0]
    want_log_probs, want_entropy = reference(model_path, batch)
    keep = batch.loss_mask > 0
    torch.testing.assert_close(log_probs.double(), want_log_probs, rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=2e-5)
    assert (log_probs[~keep] == 0).all() and (entropy[~keep] == 0).all()
