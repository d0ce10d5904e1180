"""Real Ray actors and process groups: one optimizer step under DP=2 and under CP=2 gives
the weights of DP=1 (fp32, within 1e-5 relative) for every aggregation mode."""

from __future__ import annotations

import pytest

from rollout.tiny import create_tiny_checkpoint
from tests.trainer.helpers import random_train_batch
from trainer.config import LossConfig, OptimizerConfig, TrainerConfig
from trainer.verify import Layout, verify_layouts


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def test_dp2_and_cp2_equal_dp1_for_every_mode(ray_cluster: None, tiny_model: str) -> None:
    from transformers import AutoConfig

    batch = random_train_batch(AutoConfig.from_pretrained(tiny_model).vocab_size,
                               num_prompts=3, group_size=2)
    # SGD without clipping: a wrong gradient scale shows up in the weights (Adam's first
    # step would normalise it away). KL and entropy on, so their terms are compared too.
    config = TrainerConfig(
        optimizer=OptimizerConfig(type="sgd", lr=1.0, grad_clip=None),
        loss=LossConfig(kl_coef=0.1, entropy_coef=0.01, old_log_probs="rollout"),
        max_tokens_per_micro_batch=20,
    )
    rows = verify_layouts(config, tiny_model, batch,
                          [Layout(1, 1), Layout(2, 1), Layout(1, 2)], max_response_len=8)
    assert {(r["layout"], r["mode"]) for r in rows} == {
        (layout, mode) for layout in ("dp1cp1", "dp2cp1", "dp1cp2")
        for mode in ("sample_mean", "token_mean", "prompt_mean", "constant")}
    for row in rows:
        assert row["weights"] < 1e-5, row
        for term in ("pg_loss", "kl", "entropy", "grad_norm"):
            assert row[term] < 1e-5, (term, row)
