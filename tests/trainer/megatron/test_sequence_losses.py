"""GSPO through the Megatron loss (trainer/backends/megatron/loss.py hands the objective
its CP group, None here) equals the FSDP step: gradients and one SGD step's weights, on
real Ray actors and gloo on CPU. The ratio is to the rollout's log-probs, so the
sequence ratio s_i is not 1 and its clip is active for some samples."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import random_train_batch
from tests.trainer.megatron.equivalence import Runs, assert_same
from tests.trainer.megatron.helpers import WIDE_VOCAB, create_wide_vocab_checkpoint
from trainer.config import LossConfig, OptimizerConfig, TrainerConfig

pytest.importorskip("megatron.core")


@pytest.mark.slow  # two backends on Ray actors
def test_megatron_gspo_step_equals_the_fsdp_step(ray_cluster: None,
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    config = TrainerConfig(
        optimizer=OptimizerConfig(type="sgd", lr=1.0, grad_clip=None),
        loss=LossConfig(policy_loss="gspo", eps_clip=0.05, old_log_probs="rollout"),
        max_tokens_per_micro_batch=20,
    )
    runs = Runs(create_wide_vocab_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0),
                random_train_batch(WIDE_VOCAB, num_prompts=3, group_size=2), config,
                modes=("sample_mean", "token_mean"))
    fsdp = runs("fsdp")
    assert 0 < fsdp[1]["sample_mean"].metrics["clip_fraction"] < 1  # some samples clipped
    assert_same(runs("megatron"), fsdp, tolerance=1e-4)
