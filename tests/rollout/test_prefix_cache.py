"""Kept KV across environment turns (rollout/engines/prefix_cache.py): the same tokens and
log-probs as prefilling every context whole, far fewer tokens prefilled, nothing kept
past the weights, the episodes or the byte budget it was kept for."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.base import EpisodeTurn, Generation
from rollout.engines.prefix_cache import KeptKV, PrefixCache
from rollout.engines.torch_engine import TorchEngine
from rollout.turns import TurnFormat
from tests.rollout.episode_play import SAMPLING, TOYS, play


@pytest.fixture(scope="module")
def kept(tiny_model_path: str) -> TorchEngine:
    return TorchEngine(TorchEngineConfig(batch_size=8), tiny_model_path)


@pytest.fixture(scope="module")
def whole(tiny_model_path: str) -> TorchEngine:
    """The same weights, nothing kept: every turn prefills its whole context."""
    return TorchEngine(TorchEngineConfig(batch_size=8, prefix_cache_mb=0), tiny_model_path)


def entry(tokens: list[int], turn: int = 0, episodes: str = "s", num_context: int = 1,
          length: int | None = None) -> KeptKV:
    """A kept sequence of one layer whose KV is 1 KiB per token (fp32)."""
    n = len(tokens) if length is None else length
    return KeptKV(tuple(tokens), [(torch.zeros(2, n, 64), torch.zeros(2, n, 64))], episodes,
                  turn, num_context)


def test_the_cache_finds_the_longest_prefix_and_keeps_within_its_bytes() -> None:
    cache = PrefixCache(max_bytes=10 * 1024)
    cache.begin_turn("s", 0, weight_version=3)
    cache.put(entry([1, 2, 3, 4], num_context=3))
    cache.put(entry([1, 2, 7]))
    assert [n for n, _ in cache.longest([[1, 2, 3, 4, 5], [1, 2, 7, 7], [1, 2, 3, 9], [8]])
            ] == [4, 3, 3, 0]
    # a match short of an entry's context is a sibling's: the entry stays for its own
    sibling = cache.longest([[1, 2, 9]])
    cache.take(sibling)
    assert len(cache.entries) == 2
    cache.take(cache.longest([[1, 2, 3, 9]]))  # a budget-cut action still continues it
    assert list(cache.entries) == [(1, 2, 7)]
    cache.put(entry(list(range(10, 18))))  # 3 + 8 KiB > 10: the oldest goes
    assert list(cache.entries) == [tuple(range(10, 18))] and cache.num_bytes == 8 * 1024
    cache.put(entry(list(range(11))))  # larger than the whole budget: not kept
    assert list(cache.entries) == [tuple(range(10, 18))]
    cache.begin_turn("s", 2, weight_version=3)  # kept at turn 0, not taken at turn 1
    assert not cache.entries
    cache.put(entry([5, 6], turn=2))
    cache.begin_turn("other", 0, weight_version=3)  # another set of episodes
    assert not cache.entries
    cache.put(entry([5, 6], turn=0, episodes="other"))
    cache.begin_turn("other", 1, weight_version=4)  # new weights
    assert not cache.entries and cache.num_bytes == 0


def continue_contexts(contexts: list[list[int]], actions: list[Generation], turn: int
                      ) -> list[list[int]]:
    """Next contexts: each action (every other one cut short, as a turn budget does)
    and a two-token observation."""
    out = []
    for i, (context, action) in enumerate(zip(contexts, actions, strict=True)):
        keep = len(action.token_ids) - (i % 2) * min(2, len(action.token_ids) - 1)
        out.append(context + action.token_ids[:keep] + [40 + turn, 41 + i % 3])
    return out


def assert_same(one: list[Generation], other: list[Generation]) -> None:
    for a, b in zip(one, other, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs),
                              atol=1e-5, rtol=0)


@pytest.mark.parametrize("sampling", [SAMPLING, SamplingConfig(temperature=0.0,
                                                               max_new_tokens=5)])
def test_kept_turns_sample_what_whole_prefills_sample(
        kept: TorchEngine, whole: TorchEngine, tiny_model_path: str,
        sampling: SamplingConfig) -> None:
    """Four turns of six episodes (two prompts × 3), actions cut short or not: the same
    tokens and log-probs (1e-5, fp32) as prefilling every context whole, equal to a
    teacher-forced pass, with far fewer tokens prefilled."""
    contexts = [[1, 70, 84, 4, 69, 70, 33]] * 3 + [[1, 69, 33]] * 3
    before = (kept.stats.num_prefilled_tokens, whole.stats.num_prefilled_tokens)
    for turn in range(4):
        said = EpisodeTurn(f"test:{sampling.temperature}", turn, last=turn == 3)
        mine = kept.generate(contexts, sampling, seed=turn, turn=said)
        assert_same(mine, whole.generate(contexts, sampling, seed=turn, turn=said))
        last_contexts, contexts = contexts, continue_contexts(contexts, mine, turn)
    prefilled = (kept.stats.num_prefilled_tokens - before[0],
                 whole.stats.num_prefilled_tokens - before[1])
    assert prefilled[0] * 3 < prefilled[1], prefilled
    assert not kept.prefix_cache.entries  # the last turn took every episode's KV
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    for context, action in zip(last_contexts, mine, strict=True):  # teacher-forced
        ids = torch.tensor([context + action.token_ids])
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0, len(context) - 1:-1].float()
        forced = (logits / (sampling.temperature or 1.0)).log_softmax(-1).gather(
            -1, torch.tensor(action.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(action.log_probs), forced, atol=1e-5, rtol=0)


def test_a_turn_in_two_calls_and_calls_in_chunks_find_their_kept_kv(
        tiny_model_path: str) -> None:
    """Turn 1 of eight episodes goes in two calls (as a turn near the context's end
    does), each in chunks of 3 rows: every episode still finds its own kept prefix."""
    engine = TorchEngine(TorchEngineConfig(batch_size=3), tiny_model_path)
    whole = TorchEngine(TorchEngineConfig(batch_size=3, prefix_cache_mb=0), tiny_model_path)
    contexts = [[1, 70 + i, 84, 4, 69, 33] for i in range(4) for _ in range(2)]
    first = EpisodeTurn("two-calls", 0, last=False)
    actions = engine.generate(contexts, SAMPLING, seed=1, turn=first)
    assert_same(actions, whole.generate(contexts, SAMPLING, seed=1))
    contexts = continue_contexts(contexts, actions, 0)
    second = EpisodeTurn("two-calls", 1, last=True)
    before = engine.stats.num_prefilled_tokens
    for indices, num_tokens in (([0, 3, 4, 7], 6), ([1, 2, 5, 6], 3)):
        part = [contexts[i] for i in indices]
        sampling = SAMPLING.model_copy(update={"max_new_tokens": num_tokens})
        assert_same(engine.generate(part, sampling, seed=2, turn=second),
                    whole.generate(part, sampling, seed=2))
    # per episode: the last action token (never fed), and the two of the observation
    # (three more where the action was cut short: those tokens are not in the entry)
    assert engine.stats.num_prefilled_tokens - before <= 8 * 5
    assert not engine.prefix_cache.entries


def test_new_weights_flush_what_was_kept(tiny_model_path: str,
                                         other_tiny_model_path: str) -> None:
    engine = TorchEngine(TorchEngineConfig(), tiny_model_path)
    whole = TorchEngine(TorchEngineConfig(prefix_cache_mb=0), other_tiny_model_path)
    contexts = [[1, 70, 84, 4, 69, 70, 33], [1, 69, 33]]
    actions = engine.generate(contexts, SAMPLING, seed=0, turn=EpisodeTurn("w", 0, False))
    assert len(engine.prefix_cache.entries) == 2
    other = AutoModelForCausalLM.from_pretrained(other_tiny_model_path).state_dict()
    engine.update_weights(other)
    assert not engine.prefix_cache.entries
    contexts = continue_contexts(contexts, actions, 0)
    said = EpisodeTurn("w", 1, False)
    assert_same(engine.generate(contexts, SAMPLING, seed=1, turn=said),
                whole.generate(contexts, SAMPLING, seed=1))
    engine.weight_version = 7  # a version served from elsewhere (the colocated path)
    engine.generate(contexts, SAMPLING, seed=1, turn=EpisodeTurn("w", 2, False))
    assert all(e.turn == 2 for e in engine.prefix_cache.entries.values())
    assert engine.prefix_cache.weight_version == 7


@pytest.mark.parametrize(("env", "settings", "share"), [
    ("Countdown", {"max_turns": 4, "kwargs": {"turns": 4}}, 0.5),
    # long observations (what is prefilled either way) after short actions
    ("Chatty", {"max_turns": 8, "max_total_tokens": 40, "kwargs": {"words": 3}}, 0.6),
])
def test_episodes_with_kept_kv_are_the_episodes_prefilled_whole(
        kept: TorchEngine, whole: TorchEngine, turns: TurnFormat, env: str,
        settings: dict, share: float) -> None:
    """Countdown (four turns) and Chatty (its budget cuts the turns): the same episodes,
    token for token, log-probs within 1e-5; of the same context tokens, only a share
    prefilled, the others' KV kept."""
    labels = ["a", "a", "b", "b", "c", "c"]
    before = (kept.stats.num_prefilled_tokens, whole.stats.num_prefilled_tokens,
              kept.stats.num_kept_tokens)
    mine, _ = play(kept, turns, labels, env, say_turns=True, **settings)
    theirs, _ = play(whole, turns, labels, env, say_turns=True, **settings)
    for one, other in zip(mine, theirs, strict=True):
        assert (one.prompt_ids, one.response_ids, one.response_mask, one.reward) == (
            other.prompt_ids, other.response_ids, other.response_mask, other.reward)
        assert torch.allclose(torch.tensor(one.log_probs), torch.tensor(other.log_probs),
                              atol=1e-5, rtol=0)
    assert max(e.turns for e in mine) >= 3
    prefilled = (kept.stats.num_prefilled_tokens - before[0],
                 whole.stats.num_prefilled_tokens - before[1])
    assert prefilled[0] + kept.stats.num_kept_tokens - before[2] == prefilled[1]
    assert prefilled[0] < share * prefilled[1], prefilled


def test_a_turn_near_the_context_end_in_two_calls_is_the_same(
        kept: TorchEngine, whole: TorchEngine, turns: TurnFormat) -> None:
    """A prompt that fills its budget: some turns need a second engine call."""
    budget = 24
    context = len(turns.first("talk:")) + budget
    settings = {"max_turns": 8, "max_total_tokens": budget, "kwargs": {"words": 1}}
    mine, _ = play(kept, turns, ["a"] * 8, "Chatty", context=context, say_turns=True,
                   **settings)
    theirs, _ = play(whole, turns, ["a"] * 8, "Chatty", context=context, say_turns=True,
                     **settings)
    for one, other in zip(mine, theirs, strict=True):
        assert (one.response_ids, one.response_mask) == (other.response_ids,
                                                         other.response_mask)
        assert torch.allclose(torch.tensor(one.log_probs), torch.tensor(other.log_probs),
                              atol=1e-5, rtol=0)


@pytest.mark.slow
def test_smollm2_kept_turns_decode_as_whole_prefills(smollm2_path) -> None:
    """SmolLM2's 30 layers, greedy, three chat turns with a tool's answer between them:
    the same tokens as prefilling every context whole, and log-probs as close to a
    teacher-forced pass as that path's own (each ~1e-5 from it in fp32: the prefill and
    decode matmuls round differently)."""
    from rollout.tokenizer import encode_prompt

    kept = TorchEngine(TorchEngineConfig(), str(smollm2_path))
    whole = TorchEngine(TorchEngineConfig(prefix_cache_mb=0), str(smollm2_path))
    tokenizer = kept.tokenizer
    questions = ["What is 12 times 7? Use <calc>.", "A train goes 60 km an hour. How far "
                 "in 3 hours?"]
    contexts = [encode_prompt(tokenizer, [{"role": "user", "content": q}], True)
                for q in questions for _ in range(2)]
    observation = tokenizer.encode("<|im_end|>\n<|im_start|>user\n<result>42</result>"
                                   "<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=12)
    for turn in range(3):
        said = EpisodeTurn("smollm2", turn, last=turn == 2)
        mine = kept.generate(contexts, greedy, seed=0, turn=said)
        theirs = whole.generate(contexts, greedy, seed=0, turn=said)
        for context, one, other in zip(contexts, mine, theirs, strict=True):
            assert one.token_ids == other.token_ids
            ids = torch.tensor([context + one.token_ids])
            with torch.no_grad():
                logits = kept.model(input_ids=ids).logits[0, len(context) - 1:-1].float()
            forced = logits.log_softmax(-1).gather(-1, ids[0, len(context):, None])[:, 0]
            for log_probs in (one.log_probs, other.log_probs):
                assert torch.allclose(torch.tensor(log_probs), forced, atol=5e-5, rtol=0)
        contexts = [c + g.token_ids + observation for c, g in zip(contexts, mine, strict=True)]
    assert kept.stats.num_prefilled_tokens * 2 < whole.stats.num_prefilled_tokens


def test_the_manager_says_each_turn_so_its_engine_keeps_the_kv(
        ray_cluster: None, tiny_model_path: str) -> None:
    """An environment's rollout through the manager: its engine actor prefills only a
    share of the context tokens, the others' KV kept from the turn before."""
    import ray

    from rollout.config import RolloutConfig
    from rollout.manager import RolloutManager
    from services.runtime.gang import start_rollout_actors

    config = RolloutConfig.model_validate({
        "dataset": {"type": "synthetic", "task": "copy", "num_prompts": 4, "seed": 1},
        "engine": {"type": "torch", "num_engines": 1},
        "sampling": {"max_new_tokens": 4},
        "environment": {"class_path": f"{TOYS}:Countdown", "max_turns": 3,
                        "max_total_tokens": 64},
        "n_samples_per_prompt": 2, "global_batch_size": 4, "apply_chat_template": False})
    actors = start_rollout_actors(config, tiny_model_path)
    manager = RolloutManager(config, tiny_model_path, engines=actors.engines,
                             owns_engines=True, teachers=actors.teachers,
                             reward_actors=actors.reward_actors)
    try:
        batch = manager.generate_batch(0)
        assert batch.num_samples == 4
        (engine,) = manager.engines
        stats = ray.get(engine.__ray_call__.remote(lambda self: self.stats))
        assert 0 < stats.num_prefilled_tokens < stats.num_kept_tokens, stats
    finally:
        manager.shutdown()
