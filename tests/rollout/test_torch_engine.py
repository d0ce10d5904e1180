"""TorchEngine in-process: exact log-probs, stop rules, seeds, in-place weight updates."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.base import Generation
from rollout.engines.sampling import sample_next_tokens
from rollout.engines.torch_engine import TorchEngine
from rollout.tokenizer import encode_prompt

PROMPTS = [[1, 70, 84, 4, 69, 70, 33], [1, 86, 73, 90, 4, 69, 33], [1, 69, 33], [1] + [73] * 12]
# Single-character stops on common letters: responses end at varied lengths, so the
# batch shrinks (finished rows leave the KV cache) while others keep decoding.
STOPS = ["a", "e", "i", "o", "u", "s", "t"]


@pytest.fixture(scope="module")
def engine(tiny_model_path: str) -> TorchEngine:
    return TorchEngine(TorchEngineConfig(batch_size=3), tiny_model_path)


def _teacher_forced_log_probs(
    model: torch.nn.Module, prompt: list[int], gen: Generation, temperature: float
) -> torch.Tensor:
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    log_probs = (logits / (temperature or 1.0)).log_softmax(-1)
    return log_probs.gather(-1, torch.tensor(gen.token_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0, max_new_tokens=12, stop=STOPS),
        SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, stop=STOPS),
        SamplingConfig(temperature=0.0, max_new_tokens=6),
    ],
)
def test_log_probs_match_teacher_forced_forward(
    engine: TorchEngine, tiny_model_path: str, sampling: SamplingConfig
) -> None:
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    generations = engine.generate(PROMPTS * 2, sampling, seed=3)
    assert len(generations) == 2 * len(PROMPTS)
    if sampling.stop:
        assert len({len(g.token_ids) for g in generations}) > 1  # uneven lengths exercised
    for prompt, gen in zip(PROMPTS * 2, generations, strict=True):
        expected = _teacher_forced_log_probs(reference, prompt, gen, sampling.temperature)
        assert torch.allclose(torch.tensor(gen.log_probs), expected, atol=1e-5, rtol=0)


def test_stop_rules_and_finish_reasons(engine: TorchEngine) -> None:
    sampling = SamplingConfig(max_new_tokens=12, stop=["ab", *STOPS[1:]])
    generations = engine.generate(PROMPTS * 3, sampling, seed=0)
    assert {g.finish_reason for g in generations} == {"stop", "length"}
    for gen in generations:
        assert 1 <= len(gen.token_ids) <= 12
        ends = [gen.token_ids[: k + 1] for k in range(len(gen.token_ids))]
        stopped = [
            p[-1] in engine.eos_ids or any(s in engine.tokenizer.decode(p, skip_special_tokens=True)
                                              for s in sampling.stop)
            for p in ends
        ]
        if gen.finish_reason == "stop":
            assert stopped[-1] and not any(stopped[:-1])  # stops at the first match, kept
        else:
            assert gen.finish_reason == "length" and len(gen.token_ids) == 12
            assert not any(stopped)


def test_eos_ends_the_response(engine: TorchEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend half the vocabulary is EOS so that the random model emits one quickly.
    monkeypatch.setattr(engine, "eos_ids", list(range(2, 52)))
    generations = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=20), seed=1)
    for gen in generations:
        assert gen.finish_reason == "stop" and gen.token_ids[-1] in range(2, 52)
        assert all(t >= 52 or t < 2 for t in gen.token_ids[:-1])


def test_seeds_make_sampling_reproducible(engine: TorchEngine) -> None:
    sampling = SamplingConfig(max_new_tokens=8)
    first = engine.generate(PROMPTS, sampling, seed=11)
    assert engine.generate(PROMPTS, sampling, seed=11) == first
    assert engine.generate(PROMPTS, sampling, seed=12) != first


def test_weight_update_changes_what_is_sampled(
    tiny_model_path: str, other_tiny_model_path: str
) -> None:
    engine = TorchEngine(TorchEngineConfig(), tiny_model_path)
    # Sampled, not greedy: the random tied-embedding model greedily repeats its last token
    # whatever the seed, so greedy outputs would not tell two weight sets apart.
    sampling = SamplingConfig(max_new_tokens=8)
    before = engine.generate(PROMPTS, sampling, seed=0)
    other = AutoModelForCausalLM.from_pretrained(other_tiny_model_path).state_dict()
    engine.update_weights(other)
    after = engine.generate(PROMPTS, sampling, seed=0)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    assert engine.weight_version == 1
    engine.update_weights_from_disk(tiny_model_path)  # back to the original, in place
    assert engine.generate(PROMPTS, sampling, seed=0) == before
    with pytest.raises(KeyError, match=r"unknown parameter names \['bogus.weight'\]"):
        engine.update_weights({"bogus.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"lm_head\.weight has shape"):
        engine.update_weights({"lm_head.weight": torch.zeros(3, 3)})


def test_sampling_truncation_keeps_only_allowed_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    generator = torch.Generator().manual_seed(0)
    top_p, lp = sample_next_tokens(logits, SamplingConfig(top_p=0.75), generator)
    assert set(top_p.tolist()) == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 reaches it
    assert torch.allclose(lp.exp(), torch.tensor([0.5, 0.3, 0.15, 0.05])[top_p])  # untruncated
    top_k, _ = sample_next_tokens(logits, SamplingConfig(top_k=3), generator)
    assert set(top_k.tolist()) == {0, 1, 2}
    greedy, lp = sample_next_tokens(logits[:1], SamplingConfig(temperature=0.0), generator)
    assert greedy.tolist() == [0] and lp.exp().item() == pytest.approx(0.5)


def test_draws_follow_the_distribution_and_never_a_zero_probability_token() -> None:
    from rollout.engines.sampling import inverse_cdf_draw

    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    drawn = inverse_cdf_draw(probs.repeat(40000, 1), torch.Generator().manual_seed(1))
    counts = torch.bincount(drawn, minlength=6).double() / len(drawn)
    assert counts[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(counts, probs.double(), atol=0.01)  # 4 σ at 40,000 draws
    edge = torch.tensor([[1.0, 0.0, 0.0]]).repeat(1000, 1)  # u near the total
    assert set(inverse_cdf_draw(edge, torch.Generator().manual_seed(2)).tolist()) == {0}
    last = torch.tensor([[0.0, 0.0, 1.0]]).repeat(1000, 1)  # all mass on the last token
    assert set(inverse_cdf_draw(last, torch.Generator().manual_seed(3)).tolist()) == {2}
    tail = torch.cat([torch.tensor([0.8]), torch.full((20000,), 0.2 / 20000)])
    drawn = inverse_cdf_draw(tail.repeat(2000, 1), torch.Generator().manual_seed(4))
    assert 0.17 < float((drawn > 0).double().mean()) < 0.23  # a long tail keeps its mass
    with pytest.raises(ValueError, match="not finite"):
        inverse_cdf_draw(torch.tensor([[float("nan"), 0.5]]), torch.Generator())


@pytest.mark.slow
def test_stop_strings_match_the_text_of_bpe_tokens(smollm2_path) -> None:
    """SmolLM2's BPE spells " apples" as one token, not as the tokens of "apples": the
    stop still ends the response, right after the token that completes it."""
    engine = TorchEngine(TorchEngineConfig(), str(smollm2_path))
    prompt = encode_prompt(engine.tokenizer, [{"role": "user", "content":
                                              "Tom has 3 apples and buys 5 more apples. "
                                              "How many apples does he have?"}])
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=24)
    (free,) = engine.generate([prompt], greedy, seed=0)
    text = engine.tokenizer.decode(free.token_ids)
    word = next(w.strip(".,") for w in text.split()[2:] if w.strip(".,").isalpha())
    stop_ids = engine.tokenizer.encode(word, add_special_tokens=False)
    assert not any(free.token_ids[k:k + len(stop_ids)] == stop_ids
                   for k in range(len(free.token_ids)))  # a token-id match would miss it
    (stopped,) = engine.generate([prompt], greedy.model_copy(update={"stop": [word]}), seed=0)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)]
    assert word in engine.tokenizer.decode(stopped.token_ids)
    assert word not in engine.tokenizer.decode(stopped.token_ids[:-1])


def test_a_groups_shared_prompt_is_prefilled_once_and_decodes_as_if_alone(
        tiny_model_path: str) -> None:
    engine = TorchEngine(TorchEngineConfig(batch_size=8), tiny_model_path)
    prefill_rows: list[int] = []
    hook = engine.model.register_forward_pre_hook(
        lambda _module, _args, kwargs: prefill_rows.append(kwargs["input_ids"].shape),
        with_kwargs=True)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    grouped = engine.generate([PROMPTS[0]] * 3 + [PROMPTS[3]] * 3, greedy, seed=0)
    assert prefill_rows[0] == (2, len(PROMPTS[3]))  # two distinct prompts, not six rows
    hook.remove()
    alone = [engine.generate([prompt], greedy, seed=0)[0] for prompt in (PROMPTS[0], PROMPTS[3])]
    for i, gen in enumerate(grouped):
        assert gen.token_ids == alone[i // 3].token_ids
        assert torch.allclose(torch.tensor(gen.log_probs), torch.tensor(alone[i // 3].log_probs),
                              atol=1e-5, rtol=0)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, stop=STOPS)
    sampled = engine.generate([PROMPTS[1]] * 6, sampling, seed=5)
    assert len({tuple(g.token_ids) for g in sampled}) > 1  # each row samples on its own
    for gen in sampled:
        expected = _teacher_forced_log_probs(reference, PROMPTS[1], gen, 1.0)
        assert torch.allclose(torch.tensor(gen.log_probs), expected, atol=1e-5, rtol=0)


class SeparatePrefills(TorchEngine):
    """The engine prefilling every row's prompt on its own (as before groups shared)."""

    @staticmethod
    def _distinct(prompts: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
        return [tuple(p) for p in prompts], list(range(len(prompts)))


@pytest.mark.parametrize("sampling", [
    SamplingConfig(temperature=0.0, max_new_tokens=8),
    SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=12, stop=STOPS),
])
def test_a_shared_prefill_samples_what_separate_prefills_sample(
        engine: TorchEngine, tiny_model_path: str, sampling: SamplingConfig) -> None:
    """Groups of 3 (batch_size 3: one group a chunk) and a lone prompt: the same tokens
    with the same seed, log-probs within 1e-5, and each distinct prompt prefilled once."""
    separate = SeparatePrefills(TorchEngineConfig(batch_size=3), tiny_model_path)
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[3]] * 3 + [PROMPTS[2]]
    before = (engine.stats.num_prefilled_tokens, separate.stats.num_prefilled_tokens)
    shared = engine.generate(prompts, sampling, seed=7)
    alone = separate.generate(prompts, sampling, seed=7)
    for one, other in zip(shared, alone, strict=True):
        assert one.token_ids == other.token_ids
        assert torch.allclose(torch.tensor(one.log_probs), torch.tensor(other.log_probs),
                              atol=1e-5, rtol=0)
    assert engine.stats.num_prefilled_tokens - before[0] == sum(
        len(p) for p in (PROMPTS[0], PROMPTS[3], PROMPTS[2]))
    assert separate.stats.num_prefilled_tokens - before[1] == sum(len(p) for p in prompts)


def test_weights_in_buckets_load_whole_or_not_at_all(
    tiny_model_path: str, other_tiny_model_path: str
) -> None:
    from rollout.weight_bucket import pack_bucket, plan_buckets

    engine = TorchEngine(TorchEngineConfig(dtype="bfloat16"), tiny_model_path)
    sampling = SamplingConfig(max_new_tokens=8)
    before = engine.generate(PROMPTS, sampling, seed=0)
    other = AutoModelForCausalLM.from_pretrained(other_tiny_model_path)
    shapes = [(n, tuple(p.shape)) for n, p in other.named_parameters()]
    plans = plan_buckets(shapes, "bfloat16", bucket_bytes=4096)
    assert len(plans) > 2
    buckets = [pack_bucket(specs, dict(other.named_parameters())) for specs in plans]

    broken = [*buckets[:-1], pack_bucket(  # the last bucket's first tensor mis-shaped
        [plans[-1][0].__class__(plans[-1][0].name, (1, 1), "bfloat16", 0)],
        {plans[-1][0].name: torch.zeros(1, 1)})]
    with pytest.raises(ValueError, match=rf"weight bucket {len(plans) - 1}: .* has shape"):
        engine.load_weight_buckets(broken, version=5)
    assert engine.weight_version == 0  # nothing was copied: the old weights still serve
    assert engine.generate(PROMPTS, sampling, seed=0) == before

    engine.load_weight_buckets(buckets, version=5)
    assert engine.weight_version == 5
    for name, param in other.named_parameters():  # every weight, cast to the engine's dtype
        assert torch.equal(engine.model.state_dict()[name], param.detach().bfloat16()), name


def test_receive_weights_loads_the_version_shipped_and_refuses_another(
    tiny_model_path: str, other_tiny_model_path: str
) -> None:
    """The engines' half of the object-store transport: a shipment stamped with version v
    loads only when the engine is asked for v; asked for another version, it is refused
    before any weight is touched."""
    from rollout.weight_bucket import (
        WeightShipment,
        WeightVersionMismatch,
        pack_bucket,
        plan_buckets,
    )

    engine = TorchEngine(TorchEngineConfig(), tiny_model_path)
    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    other = AutoModelForCausalLM.from_pretrained(other_tiny_model_path)
    plans = plan_buckets([(n, tuple(p.shape)) for n, p in other.named_parameters()],
                         "float32", bucket_bytes=4096)
    shipment = WeightShipment(3, tuple(pack_bucket(specs, dict(other.named_parameters()))
                                       for specs in plans))

    with pytest.raises(WeightVersionMismatch, match="asked to load weights 4, the buckets "
                                                    "sent are weights 3"):
        engine.receive_weights(4, shipment)
    assert engine.weight_version == 0
    assert all(torch.equal(t, before[n]) for n, t in engine.model.state_dict().items())

    engine.receive_weights(3, shipment)
    assert engine.weight_version == 3
    for name, param in other.named_parameters():
        assert torch.equal(engine.model.state_dict()[name], param.detach()), name
