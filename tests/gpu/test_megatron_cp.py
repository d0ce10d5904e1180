"""Megatron context parallelism on GPU: CP=2 (zigzag shards, TransformerEngine's p2p ring
attention) gives CP=1's step for every aggregation mode, within bf16 tolerance.

Two ranks need two GPUs: NCCL refuses two ranks on one device."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.tiny import create_tiny_checkpoint
from tests.gpu.needs import needs
from tests.trainer.helpers import random_train_batch
from trainer.config import (
    AggregationConfig,
    LossConfig,
    ObjectiveConfig,
    OptimizerConfig,
    TrainerConfig,
)
from trainer.verify import Layout, verify_layouts

pytestmark = pytest.mark.gpu
BF16_TOLERANCE = (1e-2, 1e-2)
"""(rtol, atol) of two bf16 runs. TE's CP and THD attention kernels (flash / fused) take
16-bit inputs only, so these layouts cannot run in fp32. bf16 keeps 8 significant bits:
unit roundoff u = 2^-8 ≈ 3.9e-3. Both layouts run the same per-token ops (embedding, MLP,
norms, head, the fp32 loss on fp32 log-probs) and differ only in how attention is
partitioned and merged (partial softmax statistics merged in fp32, the output rounded
once to bf16), so each gradient element differs by about u, a few u after the two
layers' backward, of its tensor's scale: 1e-2 ≈ 2.5u. The aggregation errors this guards
against are far larger: ×2 on a rank, a per-rank normalisation off by the ranks'
imbalance, a sample's weight dropped (1/N = 1/6 of J here). fp32 layouts (every other
verifier test) are held to 1e-4, float64 ones to 1e-7."""


@needs(2, ("megatron.core", "transformer_engine"))
def test_megatron_cp2_equals_cp1_with_te_attention(ray_cluster: None, tmp_path: Path) -> None:
    model_path = create_tiny_checkpoint(tmp_path, seed=0)
    config = TrainerConfig(
        backend="megatron", num_gpus_per_rank=1, dtype="bfloat16",  # TE's CP kernels: 16-bit
        optimizer=OptimizerConfig(type="sgd", lr=1.0, grad_clip=None),
        loss=LossConfig(kl_coef=0.1, entropy_coef=0.01, old_log_probs="rollout"),
        max_tokens_per_micro_batch=20,
    )
    batch = random_train_batch(100, num_prompts=3, group_size=2)
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 8, 1.0)
    rows = verify_layouts(config, objective, model_path, batch, [Layout(1, 1), Layout(1, 2)],
                          tolerance=BF16_TOLERANCE)
    assert {r.layout for r in rows} == {"dp1cp2"}
    assert len(rows) == 12  # 4 modes × (pg, KL, entropy)
    for row in rows:
        assert row.ok, row


@needs(2, ("megatron.core", "transformer_engine"))
def test_megatron_packed_thd_rows_equal_padded_micro_batches(ray_cluster: None,
                                                             tmp_path: Path) -> None:
    """Packed rows through PackedSeqParams (THD) against padded micro-batches, without
    CP and with CP=2 (each sample zigzag-sharded on its own), every mode and term."""
    model_path = create_tiny_checkpoint(tmp_path, seed=0)
    config = TrainerConfig(
        backend="megatron", num_gpus_per_rank=1, dtype="bfloat16",
        optimizer=OptimizerConfig(type="sgd", lr=1.0, grad_clip=None),
        loss=LossConfig(kl_coef=0.1, entropy_coef=0.01, old_log_probs="rollout"),
        max_tokens_per_micro_batch=24,
    )
    batch = random_train_batch(100, num_prompts=3, group_size=2)
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 8, 1.0)
    rows = verify_layouts(config, objective, model_path, batch,
                          [Layout(1, 1, packed=False), Layout(1, 1, packed=True),
                           Layout(1, 2, packed=True)], tolerance=BF16_TOLERANCE)
    assert {r.layout for r in rows} == {"dp1cp1-packed", "dp1cp2-packed"}
    for row in rows:
        assert row.ok, row
