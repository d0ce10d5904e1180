"""SmolLM2 pads with its EOS (``pad_token_id == eos_token_id``), and its chat template
puts that same token (``<|im_end|>``) inside every prompt: masks must come from lengths,
never from comparing ids with the pad id. The EOS that ends a response stays in the loss;
padding and the prompt's own EOS tokens do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.batch import RolloutBatch
from rollout.tokenizer import encode_completion, encode_prompt, load_tokenizer
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.micro_batch import slice_packed_row
from trainer.step_plan import plan_step


@pytest.mark.slow
def test_the_eos_ending_a_response_is_trained_on_and_padding_is_not(smollm2_path: Path
                                                                   ) -> None:
    tokenizer = load_tokenizer(str(smollm2_path))
    eos = tokenizer.eos_token_id
    assert tokenizer.pad_token_id == eos
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q}])
               for q in ("What is 2 + 3?", "Sam has 4 pens and buys 7 more. How many now?")]
    assert all(eos in p for p in prompts)  # the template closes the system/user turns with it
    responses = [encode_completion(tokenizer, "\\boxed{5}"),
                 encode_completion(tokenizer, "4 + 7 = 11, so \\boxed{11}.")]
    batch = RolloutBatch.from_samples(
        prompt_ids=prompts, response_ids=responses,
        response_log_probs=[[-0.5] * len(r) for r in responses], rewards=[1.0, 0.0],
        advantages=[0.5, -0.5], group_index=[0, 1], samples_per_prompt=1, pad_token_id=eos)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        end = len(prompt) + len(response)
        assert batch.input_ids[i, end - 1] == eos and response[-1] == eos
        assert batch.loss_mask[i, end - 1] == 1  # the response's EOS is in the loss
        assert batch.loss_mask[i, :len(prompt)].sum() == 0  # the prompt's EOS tokens are not
        assert batch.loss_mask[i, end:].sum() == 0  # nor the padding (also EOS ids)
        assert (batch.input_ids[i, end:] == eos).all()
        assert batch.sample_token_counts[i] == len(response)
    assert batch.input_ids.shape[1] > len(prompts[0]) + len(responses[0])  # row 0 is padded
    # The trainer's packed row is cut by lengths too: every response token is a target in
    # the loss, each response's final EOS included, and no prompt EOS is.
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 64, 1.0)
    plan = plan_step(batch, objective, dp_size=1, cp_size=1, max_tokens_per_micro_batch=4096)
    (row,) = plan.micro_batches[0]
    micro = slice_packed_row(batch, plan, row, cp_size=1, cp_rank=0)
    assert int(micro.loss_mask.sum()) == sum(map(len, responses))
    assert int(((micro.targets == eos) & (micro.loss_mask == 1)).sum()) == len(responses)
    assert int((micro.targets == eos).sum()) > len(responses)  # prompt EOS: targets, not loss
