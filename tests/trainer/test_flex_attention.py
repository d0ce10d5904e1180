"""FlexAttention (eager, CPU forward) and the SDPA kernels on packed rows sharing a
prompt, for a GQA Qwen2, a Qwen2 whose second layer slides a window, and a GQA Mistral
sliding every layer (tiny random models from configs): each sample's log-probs in the
row equal the sample run alone through Hugging Face's own attention (1e-5, fp32). K/V
reach flex_attention at their kv heads; the BlockMask is built once per micro-batch and
window size; the planted prefix error moves both kernels alike."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import trainer.attention_flex as attention_flex
from rollout.batch import RolloutBatch
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.cp_attention import context_parallel, enable_context_parallel
from trainer.micro_batch import slice_packed_row
from trainer.step_plan import plan_step

pytestmark = pytest.mark.filterwarnings(  # eager FlexAttention on CPU, as intended here
    "ignore:flex_attention called without torch.compile")
VOCAB, WINDOW = 48, 6
DIMS = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": VOCAB,
        "max_position_embeddings": 64, "initializer_range": 0.2}
"""Larger weights than the default 0.02, so attention is far from uniform and a wrong
mask shows."""
MODELS = {
    "qwen2-gqa": (Qwen2ForCausalLM, Qwen2Config(**DIMS)),
    "qwen2-window": (Qwen2ForCausalLM, Qwen2Config(**DIMS, use_sliding_window=True,
                                                   sliding_window=WINDOW, max_window_layers=1)),
    "mistral-gqa-window": (MistralForCausalLM, MistralConfig(**DIMS, sliding_window=WINDOW,
                                                             head_dim=8)),
}


def _model(name: str, attention: str) -> torch.nn.Module:
    cls, config = MODELS[name]
    torch.manual_seed(0)
    model = cls(copy.deepcopy(config)).float().eval()  # each model switches its own config
    model.set_attn_implementation(attention)
    return model


def _batch() -> RolloutBatch:
    """Two groups of 3 sharing their prompts (responses longer than the window) and one
    group whose prompts differ."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    prompts = [ids(5)] * 3 + [ids(4)] * 3 + [ids(3), ids(4), ids(2)]
    responses = [ids(n) for n in (9, 4, 12, 7, 7, 3, 5, 8, 2)]
    return RolloutBatch.from_samples(prompts, responses, [[-1.0] * len(r) for r in responses],
                                     [0.0] * 9, [0.5] * 9, [0, 0, 0, 1, 1, 1, 2, 2, 2], 3)


def _row_log_probs(model: torch.nn.Module, batch: RolloutBatch, planted: bool = False
                   ) -> list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(samples, slot, position, log-softmax) of every row of the shared-prefix plan."""
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)
    plan = plan_step(batch, objective, 1, 1, 256, shared_prefix=True)
    assert plan.prefix_skip is not None and plan.prefix_skip.any()
    rows = []
    for samples in plan.micro_batches[0]:
        micro = slice_packed_row(batch, plan, samples, 1, 0)
        layout = micro.layout
        if planted:
            layout = type(layout).build(layout.lengths_N, starts_N=layout.starts_N,
                                        heads_N=layout.heads_N, planted=True)
        with torch.no_grad(), context_parallel(None, micro.position_ids, layout):
            logits = model(input_ids=micro.input_ids, position_ids=micro.position_ids).logits
        rows.append((samples, layout.slot_T, layout.position_T, logits[0].log_softmax(-1)))
    return rows


@pytest.mark.parametrize("kernel", ["flex_attention", "sdpa"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_shared_prefix_row_gives_each_samples_log_probs_alone(name: str, kernel: str
                                                                ) -> None:
    batch = _batch()
    model = _model(name, "sdpa")
    enable_context_parallel(model, kernel)
    alone_model = _model(name, "sdpa")  # Hugging Face's own causal / sliding-window mask
    checked = 0
    for samples, slot, position, log_probs in _row_log_probs(model, batch):
        for k, i in enumerate(samples):
            n = int(batch.sequence_lengths[i])
            with torch.no_grad():
                alone = alone_model(input_ids=batch.input_ids[i:i + 1, :n]).logits[0]
            mine = slot == k
            torch.testing.assert_close(log_probs[mine], alone.log_softmax(-1)[position[mine]],
                                       rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == batch.num_samples


def test_flex_gets_kv_heads_and_one_block_mask_per_window(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Qwen2 with a full layer and a sliding one: two BlockMasks per row (one per window
    size), and every flex_attention call has K/V at the config's kv heads, GQA on."""
    calls: list[tuple[int, int, bool]] = []
    masks: list[int | None] = []
    real_flex, real_mask = attention_flex.flex_attention, attention_flex.row_block_mask

    def flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: object
             ) -> torch.Tensor:
        calls.append((query.shape[1], key.shape[1], bool(kwargs["enable_gqa"])))
        assert value.shape[1] == key.shape[1]
        return real_flex(query, key, value, **kwargs)

    def block_mask(layout: object, window: int | None = None) -> object:
        masks.append(window)
        return real_mask(layout, window)

    monkeypatch.setattr(attention_flex, "flex_attention", flex)
    monkeypatch.setattr(attention_flex, "row_block_mask", block_mask)
    model = _model("qwen2-window", "sdpa")
    enable_context_parallel(model, "flex_attention")
    rows = _row_log_probs(model, _batch())
    config = MODELS["qwen2-window"][1]
    assert set(calls) == {(config.num_attention_heads, config.num_key_value_heads, True)}
    assert len(calls) == config.num_hidden_layers * len(rows)
    assert masks == [None, WINDOW] * len(rows)


def test_the_planted_prefix_error_moves_flex_and_sdpa_alike() -> None:
    batch = _batch()
    results = {}
    for kernel in ("flex_attention", "sdpa"):
        model = _model("qwen2-gqa", "sdpa")
        enable_context_parallel(model, kernel)
        results[kernel] = [_row_log_probs(model, batch, planted)[0][3]
                           for planted in (False, True)]
    for kernel, (clean, planted) in results.items():
        assert (clean - planted).abs().max() > 1e-3, kernel
    torch.testing.assert_close(results["flex_attention"][1], results["sdpa"][1],
                               rtol=1e-5, atol=1e-5)
