"""Packed rows on the real model: the logits of a row holding several samples equal each
sample run alone, without CP and split over 2 CP ranks (real gloo groups)."""

from __future__ import annotations

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_distributed
from tests.trainer.helpers import random_train_batch
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.context_parallel import zigzag_unshard
from trainer.step_plan import plan_step


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def packed_logits(rank: int, world_size: int, model_path: str, batch, plan
                  ) -> list[torch.Tensor]:
    """This CP rank's logits of every packed row of DP rank 0."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from trainer.cp_attention import context_parallel, enable_context_parallel
    from trainer.micro_batch import slice_packed_row

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    enable_context_parallel(model)
    group = dist.new_group(list(range(world_size)))
    out = []
    with torch.no_grad():
        for samples in plan.micro_batches[0]:
            micro = slice_packed_row(batch, plan, samples, world_size, rank)
            with context_parallel(group, micro.position_ids, micro.layout):
                out.append(model(input_ids=micro.input_ids,
                                 position_ids=micro.position_ids).logits[0])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [1, 2])
def test_a_packed_row_gives_each_samples_logits_alone(tiny_model: str, cp_size: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = AutoConfig.from_pretrained(tiny_model).vocab_size
    batch = random_train_batch(vocab, num_prompts=4, group_size=3, seed=2)
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)
    plan = plan_step(batch, objective, dp_size=1, cp_size=cp_size, max_tokens_per_micro_batch=40)
    rows = plan.micro_batches[0]
    assert len(rows) >= 2 and max(len(r) for r in rows) >= 3  # several rows, several samples
    per_rank = run_distributed(packed_logits, cp_size, tiny_model, batch, plan)
    alone_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    checked = 0
    for r, (samples, bounds) in enumerate(zip(rows, plan.cu_seqlens[0], strict=True)):
        offset = 0
        for slot, i in enumerate(samples):
            n = int(batch.sequence_lengths[i])
            local = (bounds[slot + 1] - bounds[slot]) // cp_size
            got = zigzag_unshard([logits[r][offset:offset + local] for logits in per_rank], n,
                                 dim=0)
            offset += local
            with torch.no_grad():
                alone = alone_model(input_ids=batch.input_ids[i:i + 1, :n]).logits[0]
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == batch.num_samples


def shared_prefix_logits(rank: int, world_size: int, model_path: str, batch, plan
                         ) -> list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(samples, slot, position, logits) of every shared-prefix row of DP rank 0."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from trainer.cp_attention import context_parallel, enable_context_parallel
    from trainer.micro_batch import packed_row_index, slice_packed_row

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    enable_context_parallel(model)
    group = dist.new_group(list(range(world_size)))
    out = []
    with torch.no_grad():
        for samples in plan.micro_batches[0]:
            micro = slice_packed_row(batch, plan, samples, 1, 0)
            index = torch.tensor(samples)
            slot, position = packed_row_index(batch.sequence_lengths[index], 1, 0,
                                              plan.prefix_skip[index])
            with context_parallel(group, micro.position_ids, micro.layout):
                logits = model(input_ids=micro.input_ids,
                               position_ids=micro.position_ids).logits[0]
            out.append((samples, slot, position, logits))
    return out


def test_a_shared_prefix_row_gives_each_samples_logits_alone(tiny_model: str) -> None:
    """Groups of identical prompts (of different lengths) share them; a group whose
    prompts differ shares nothing; every response position's logits (those the loss and
    the log-probs read) equal the sample run alone, and so do the prompt's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.batch import RolloutBatch
    from trainer.attention_pieces import plan_pieces
    from trainer.micro_batch import slice_packed_row

    vocab = AutoConfig.from_pretrained(tiny_model).vocab_size
    shared = random_train_batch(vocab, num_prompts=3, group_size=3, seed=4)
    prompts = [shared.input_ids[i, :int(shared.prompt_lengths[i])].tolist()
               for i in range(shared.num_samples)]
    responses = [shared.input_ids[i, int(shared.prompt_lengths[i]):
                                  int(shared.sequence_lengths[i])].tolist()
                 for i in range(shared.num_samples)]
    prompts[6:9] = [[5, 6, 7], [5, 6, 8], [9, 6, 7, 4]]  # group 2: prompts differ
    gen = torch.Generator().manual_seed(0)  # group 0: long responses of one length
    responses[0:3] = [torch.randint(3, vocab, (100,), generator=gen).tolist() for _ in range(3)]
    batch = RolloutBatch.from_samples(prompts, responses, [[-1.0] * len(r) for r in responses],
                                      [0.0] * 9, [0.5] * 9, [0, 0, 0, 1, 1, 1, 2, 2, 2], 3)
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)
    plan = plan_step(batch, objective, dp_size=1, cp_size=1, max_tokens_per_micro_batch=512,
                     shared_prefix=True)
    skip = plan.prefix_skip
    assert skip is not None and skip[6:].tolist() == [0, 0, 0]
    assert sorted(skip[:6].tolist()) == sorted([0, *[int(batch.prompt_lengths[0]) - 1] * 2,
                                                0, *[int(batch.prompt_lengths[3]) - 1] * 2])
    assert plan.computed_tokens == int((batch.sequence_lengths - skip).sum())
    kinds = set()  # group 0 attends run by run, group 1 (short, uneven) under one mask
    for samples in plan.micro_batches[0]:
        micro = slice_packed_row(batch, plan, samples, 1, 0)
        kinds |= {"mask" if p.mask is not None else "prefix" if p.prefix_keys[1] else "alone"
                  for p in plan_pieces(micro.layout)}
    assert kinds == {"mask", "prefix", "alone"}
    (rows,) = run_distributed(shared_prefix_logits, 1, tiny_model, batch, plan)
    alone_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    seen = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    for samples, slot, position, logits in rows:
        for k, i in enumerate(samples):
            n = int(batch.sequence_lengths[i])
            with torch.no_grad():
                alone = alone_model(input_ids=batch.input_ids[i:i + 1, :n]).logits[0]
            mine = slot == k
            torch.testing.assert_close(logits[mine], alone[position[mine]], rtol=1e-5,
                                       atol=1e-5)
            seen[i, position[mine]] = True
    # every token a loss reads (positions P−1 … L−2 of every sample) was computed
    for i in range(batch.num_samples):
        p, n = int(batch.prompt_lengths[i]), int(batch.sequence_lengths[i])
        assert seen[i, p - 1:n - 1].all()
