"""Packed rows on GPU through flash-attention's varlen kernel: a row's logits equal each
sample run alone (bf16 tolerance), and the FSDP rank switches that kernel on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.gpu.needs import needs
from tests.trainer.helpers import random_train_batch
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig, TrainerConfig
from trainer.step_plan import plan_step

pytestmark = pytest.mark.gpu


def _flash_attn_2() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()  # not find_spec: flash-attn-4 provides the module


@needs(1)
@pytest.mark.skipif(not _flash_attn_2(), reason="needs flash-attention 2 (flash-attn >= 2.3.3)")
def test_varlen_flash_attention_on_packed_rows_equals_each_sample_alone(tmp_path: Path
                                                                        ) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.backends.fsdp.model import configure_attention
    from trainer.micro_batch import slice_packed_row

    model_path = create_tiny_checkpoint(tmp_path, seed=0)
    batch = random_train_batch(AutoConfig.from_pretrained(model_path).vocab_size,
                               num_prompts=4, group_size=3)
    plan = plan_step(batch, ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0),
                     1, 1, 40)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
    choice = configure_attention(model, TrainerConfig(num_gpus_per_rank=1,
                                                      shared_prefix=False))
    assert choice.implementation == "flash_attention_2", choice
    alone_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        for samples in plan.micro_batches[0]:
            micro = slice_packed_row(batch, plan, samples, 1, 0).to(torch.device("cuda"))
            logits = model(input_ids=micro.input_ids, position_ids=micro.position_ids).logits[0]
            offset = 0
            for i in samples:
                n = int(batch.sequence_lengths[i])
                alone = alone_model(input_ids=batch.input_ids[i:i + 1, :n].cuda()).logits[0]
                torch.testing.assert_close(logits[offset:offset + n].float(), alone.float(),
                                           rtol=2e-2, atol=2e-2)
                offset += n
