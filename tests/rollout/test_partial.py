"""Partial rollouts (rollout/partial.py) on a real local Ray cluster with the tiny model:
a sample continued across a weight update holds exactly what an engine loading the new
weights at that token produces; each token's log-prob is its own version's; steps take the
first whole groups done and keep N; a resume with samples in flight is bit for bit."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from rollout.batch import RolloutBatch
from rollout.config import RolloutConfig, SamplingConfig, TorchEngineConfig
from rollout.engines.base import EpisodeTurn
from rollout.engines.torch_engine import TorchEngine
from rollout.manager import RolloutManager
from services.runtime.gang import start_rollout_actors

CHUNK = 4
CONFIG = RolloutConfig.model_validate({
    "dataset": {"type": "synthetic", "task": "copy", "num_prompts": 32, "seed": 1},
    "engine": {"type": "torch", "num_engines": 2, "batch_size": 16},
    "sampling": {"max_new_tokens": 16, "temperature": 1.0},
    "n_samples_per_prompt": 2,
    "global_batch_size": 4,
    "async_steps": 1,
    "partial_rollout": True,
    "partial_chunk_tokens": CHUNK,
    "seed": 3,
})


def _weights(path: str, noise_seed: int | None) -> dict[str, torch.Tensor]:
    """The model's state dict; with ``noise_seed``, every weight moved a little (another
    weight version of the same model)."""
    state = AutoModelForCausalLM.from_pretrained(path).state_dict()
    if noise_seed is None:
        return state
    generator = torch.Generator().manual_seed(noise_seed)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator)
            for name, t in state.items()}


@pytest.fixture(scope="module")
def versions(eos_prone_model_path: str) -> dict[int, dict[str, torch.Tensor]]:
    """Weight version -> its state dict (0: the checkpoint the engines load)."""
    return {0: _weights(eos_prone_model_path, None),
            **{v: _weights(eos_prone_model_path, v) for v in (1, 2, 3, 4)}}


@pytest.fixture(scope="module")
def manager(ray_cluster: None, eos_prone_model_path: str) -> Iterator[RolloutManager]:
    actors = start_rollout_actors(CONFIG, eos_prone_model_path)
    manager = RolloutManager(CONFIG, eos_prone_model_path, engines=actors.engines,
                             owns_engines=True, teachers=actors.teachers,
                             reward_actors=actors.reward_actors)
    yield manager
    manager.shutdown()


def _load(manager: RolloutManager, weights: dict[str, torch.Tensor], version: int) -> None:
    manager.update_weights([ray.put(weights)], version)


def _per_token_reference(batch: RolloutBatch, models: dict[int, torch.nn.Module],
                         one_version_per_sample: bool = False) -> torch.Tensor:
    """Each response token's log-prob teacher-forced under the weights of its version
    (``one_version_per_sample``: all under the version of the sample's first token, the
    planted error), [N, S] like rollout_log_probs."""
    expected = torch.zeros_like(batch.rollout_log_probs)
    assert batch.token_versions is not None
    for i in range(batch.num_samples):
        start, end = int(batch.prompt_lengths[i]), int(batch.sequence_lengths[i])
        ids = batch.input_ids[i:i + 1, :end]
        tokens = batch.input_ids[i, start:end]
        for version in batch.token_versions[i, start:end].unique().tolist():
            with torch.no_grad():
                log_probs = models[version](input_ids=ids).logits[0, start - 1:end - 1] \
                    .float().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
            mine = batch.token_versions[i, start:end] == version
            if one_version_per_sample:
                mine = torch.full_like(mine, version == int(batch.token_versions[i, start]))
            expected[i, start:end] = torch.where(mine, log_probs, expected[i, start:end])
    return expected


def _models(eos_prone_model_path: str, versions: dict[int, dict[str, torch.Tensor]]
            ) -> dict[int, torch.nn.Module]:
    models = {}
    for version, state in versions.items():
        model = AutoModelForCausalLM.from_pretrained(eos_prone_model_path).eval()
        model.load_state_dict(state)
        models[version] = model
    return models


def test_steps_take_the_first_groups_done_and_each_token_its_version(
    manager: RolloutManager, versions: dict[int, dict[str, torch.Tensor]],
    eos_prone_model_path: str,
) -> None:
    """Four steps, new weights before each after the first (as async_steps 1 has them:
    step s's call under weights s − 1): whole groups, N each, contiguous group indices;
    token versions, staleness and partial fraction agree; each token's rollout log-prob
    is its own version's (a reference with one version per sample differs)."""
    batches = []
    for step in range(4):
        if step >= 2:
            _load(manager, versions[step - 1], step - 1)
        if step == 0:
            pool_before = manager.partial.state_dict()  # type: ignore[union-attr]
            assert pool_before["groups"] == []
        batches.append(manager.generate_batch(step))
        if step == 0:
            after_first = manager.partial.state_dict()  # type: ignore[union-attr]
    group_index = torch.cat([b.group_index for b in batches]).tolist()
    assert group_index == [g for g in range(8) for _ in range(2)]  # whole, contiguous, N = 4
    # Step 0 began with an empty pool of 4 groups at version 0: the two taken are the
    # first done; the groups left are unfinished or done no earlier.
    first = batches[0]
    taken_round = max(math.ceil(int(n) / CHUNK) - 1 for n in first.response_lengths)
    for group in after_first["groups"]:
        assert group["done_round"] is None or group["done_round"] >= taken_round
    assert any(s["tokens"] and s["finish"] is None
               for g in after_first["groups"] for s in g["samples"])  # paused mid-response
    models = _models(eos_prone_model_path, versions)
    spanning = 0
    for step, batch in enumerate(batches):
        assert batch.token_versions is not None
        response = batch.loss_mask > 0
        lags = step - batch.token_versions[response]
        assert batch.metadata["rollout/staleness_max"] == float(lags.max())
        assert batch.metadata["rollout/staleness_mean"] == pytest.approx(float(
            lags.double().mean()))
        assert int(lags.max()) <= CONFIG.staleness_bound
        spans = [len(set(batch.token_versions[i][response[i]].tolist())) > 1
                 for i in range(batch.num_samples)]
        assert batch.metadata["rollout/partial_fraction"] == sum(spans) / len(spans)
        spanning += sum(spans)
        expected = _per_token_reference(batch, models)
        assert torch.allclose(batch.rollout_log_probs, expected, atol=1e-5), step
        if any(spans):  # the planted error: one version per sample
            planted = _per_token_reference(batch, models, one_version_per_sample=True)
            assert not torch.allclose(batch.rollout_log_probs, planted, atol=1e-3)
    assert spanning > 0  # some sample's tokens came from two versions


def test_resume_with_samples_in_flight_is_exact(
    manager: RolloutManager, versions: dict[int, dict[str, torch.Tensor]]
) -> None:
    """The manager's state (pool included) after a step; two more steps with a weight
    load between; the state and the weights of then loaded again give both bit for bit."""
    _load(manager, versions[3], 3)
    manager.generate_batch(5)
    state = manager.state_dict()
    assert any(s["tokens"] for g in state["partial"]["groups"] for s in g["samples"])

    def two_steps() -> list[RolloutBatch]:
        first = manager.generate_batch(6)
        _load(manager, versions[4], 4)
        return [first, manager.generate_batch(7)]

    runs = [two_steps()]
    manager.load_state_dict(state)
    _load(manager, versions[3], 3)
    runs.append(two_steps())
    for a, b in zip(*runs, strict=True):
        for name in ("input_ids", "rollout_log_probs", "token_versions", "rewards",
                     "group_index", "loss_mask"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert manager.state_dict() != state


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuation_equals_an_engine_loading_the_weights_at_that_token(
    eos_prone_model_path: str, versions: dict[int, dict[str, torch.Tensor]],
    temperature: float,
) -> None:
    """The rounds as the manager sends them (context = prompt + tokens so far, the
    partial set's turns): C tokens under version 0, a weight load, C more. The second
    round equals a fresh engine holding version 1 given the same context and seed; a
    round under unchanged weights (its KV kept from the round before) equals a fresh
    engine's full prefill; greedy, the tokens are each version's argmax."""
    chunk = SamplingConfig(max_new_tokens=CHUNK, temperature=temperature)
    prompts = [[5, 9, 13, 7], [5, 9, 13, 7], [21, 22, 8]]
    engine = TorchEngine(TorchEngineConfig(batch_size=4), eos_prone_model_path)
    first = engine.generate(prompts, chunk, seed=11, turn=EpisodeTurn("partial", 0, False))
    contexts = [p + g.token_ids for p, g in zip(prompts, first, strict=True)]
    same_version = engine.generate(contexts, chunk, seed=12,
                                   turn=EpisodeTurn("partial", 1, False))
    assert engine.stats.num_kept_tokens > 0  # the second round read the first's KV
    fresh = TorchEngine(TorchEngineConfig(batch_size=4), eos_prone_model_path)
    full_prefill = fresh.generate(contexts, chunk, seed=12)
    for kept, full in zip(same_version, full_prefill, strict=True):
        assert kept.token_ids == full.token_ids
        assert torch.allclose(torch.tensor(kept.log_probs), torch.tensor(full.log_probs),
                              atol=1e-6)
    engine.update_weights(versions[1])
    continued = engine.generate(contexts, chunk, seed=12, turn=EpisodeTurn("partial", 2, False))
    fresh.update_weights(versions[1])
    at_that_token = fresh.generate(contexts, chunk, seed=12)
    for a, b in zip(continued, at_that_token, strict=True):
        assert a.token_ids == b.token_ids and a.log_probs == b.log_probs
    if temperature == 0.0:  # each version's argmax, from a plain forward pass
        models = _models(eos_prone_model_path, {0: versions[0], 1: versions[1]})
        for context, prompt, gens in zip(contexts, prompts,
                                         zip(first, continued, strict=True), strict=True):
            ids = list(prompt)
            for version, generation in enumerate(gens):
                for token in generation.token_ids:
                    with torch.no_grad():
                        logits = models[version](input_ids=torch.tensor([ids])).logits[0, -1]
                    assert token == int(logits.argmax())
                    ids.append(token)
                if version == 0:
                    assert ids == context


def test_dynamic_sampling_on_the_stream_keeps_groups_with_spread(
    ray_cluster: None, eos_prone_model_path: str, tmp_path: Path,
) -> None:
    """Every other record is flat (its group scores all 0): the groups taken from the pool
    without spread are set aside and more are taken, so the step holds only groups with
    spread, whole, N of them."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"cp {c}=", "label": c, "flat": i % 2 == 0})
                              for i, c in enumerate("abcdefghijklmnop")))
    config = RolloutConfig.model_validate({
        **CONFIG.model_dump(), "engine": {"type": "torch", "num_engines": 1},
        "dataset": {"type": "jsonl", "path": str(path), "shuffle": False},
        "reward": {"type": "custom",
                   "custom_function": "tests.rollout.reward_fns:spread_unless_flat"},
        "n_samples_per_prompt": 4, "global_batch_size": 8,
        "dynamic_sampling": {"enabled": True, "max_draws": 8}})
    actors = start_rollout_actors(config, eos_prone_model_path)
    manager = RolloutManager(config, eos_prone_model_path, engines=actors.engines,
                             owns_engines=True, teachers=actors.teachers,
                             reward_actors=actors.reward_actors)
    try:
        batches = [manager.generate_batch(step) for step in range(2)]
        for step, batch in enumerate(batches):
            assert batch.num_samples == 8 and batch.group_index.tolist() == [
                g for g in (2 * step, 2 * step + 1) for _ in range(4)]
            assert batch.metadata["rollout/zero_spread_filled"] == 0
            assert all(g.max() > g.min() for g in batch.rewards.view(2, 4))
        # The pool's first 4 groups hold 2 flat records (unshuffled): step 0 took one at
        # least, set it aside, and took again.
        first = batches[0].metadata
        assert first["rollout/zero_spread_groups"] >= 1 and first["rollout/num_draws"] >= 2
    finally:
        manager.shutdown()


def test_rounds_on_the_sglang_engine_continue_each_sample_from_its_tokens(
    tiny_model_path: str,
) -> None:
    """The pool's rounds through the SGLang engine (a loopback fake of its HTTP API, whose
    response is a documented function of the ids it is sent): each sample's tokens are
    what successive requests of C tokens, each sent prompt + the tokens so far, return —
    the fake's own formula, replayed here — and every request asks for C tokens."""
    from rollout.config import SGLangEngineConfig
    from rollout.engines.sglang_engine import SGLangEngine
    from rollout.partial import PartialRollouts, PartialStats
    from tests.rollout.fake_sglang import fake_generation, serve_fake_sglang

    prompts = iter([(i, [1, 60 + i, 7 * i % 11 + 3]) for i in range(8)])
    pool = PartialRollouts(group_size=2, max_new_tokens=16, chunk_tokens=4, pool_groups=3,
                           max_staleness=8)
    chunk = SamplingConfig(max_new_tokens=4, temperature=1.0)
    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url], max_batch_size=4),
                              tiny_model_path)

        def decode(contexts: list[list[int]], round_number: int) -> list:
            return [dataclasses.replace(g, versions=[0] * len(g.token_ids))
                    for g in engine.generate(contexts, chunk, round_number,
                                             EpisodeTurn("partial", round_number, False))]

        taken = pool.take(3, lambda n: [next(prompts) for _ in range(n)], decode,
                          PartialStats())  # the whole pool: every sample to its end
    posts = [body for route, body in fake.requests if route == "/generate"]
    assert posts and all(body["sampling_params"]["max_new_tokens"] == 4 for body in posts)
    for group in [*taken, *pool.groups]:
        for sample in group.samples:
            expected: list[int] = []
            while len(expected) < len(sample.tokens):
                meta = fake_generation(group.prompt_ids + expected,
                                       {"max_new_tokens": 4})["meta_info"]
                expected += [t for _, t, _ in meta["output_token_logprobs"]]
            assert sample.tokens == expected
    assert len(taken) == 3 and all(s.finish is not None for g in taken for s in g.samples)
    assert max(len(s.tokens) for g in taken for s in g.samples) > 4  # continued at least once
