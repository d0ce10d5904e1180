"""RolloutManager on a real local Ray cluster with the tiny model: the RolloutBatch layout,
exact resume, weight updates through the object store, dynamic sampling."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from rollout.batch import RolloutBatch
from rollout.config import RolloutConfig, SGLangEngineConfig
from rollout.datasets import DatasetError
from rollout.engines import EngineUnavailableError
from rollout.manager import RolloutManager, RolloutManagerActor
from rollout.tokenizer import load_tokenizer
from services.runtime.gang import start_rollout_actors

STOPS = ["a", "e", "i", "o"]  # uneven response lengths from a random model
CONFIG = RolloutConfig.model_validate(
    {
        "dataset": {"type": "synthetic", "task": "copy", "num_prompts": 6, "seed": 1},
        "engine": {"type": "torch", "num_engines": 2, "batch_size": 3},
        "sampling": {"max_new_tokens": 8, "stop": STOPS},
        "n_samples_per_prompt": 4,
        "global_batch_size": 8,
        "seed": 5,
    }
)


@pytest.fixture(scope="module")
def manager(ray_cluster: None, tiny_model_path: str) -> Iterator[ray.actor.ActorHandle]:
    actors = start_rollout_actors(CONFIG, tiny_model_path)
    actor = RolloutManagerActor.remote(CONFIG, tiny_model_path, engines=actors.engines,
                                       owns_engines=True, teachers=actors.teachers,
                                       reward_actors=actors.reward_actors)
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


def _assert_same(a: RolloutBatch, b: RolloutBatch) -> None:
    for name in ("input_ids", "loss_mask", "rollout_log_probs", "rewards", "group_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.slow
def test_batch_layout_groups_masks_and_log_probs(
    manager: ray.actor.ActorHandle, tiny_model_path: str
) -> None:
    first, second = ray.get([manager.generate_batch.remote(0), manager.generate_batch.remote(1)])
    assert first.group_index.tolist() == [0] * 4 + [1] * 4
    assert second.group_index.tolist() == [2] * 4 + [3] * 4  # keeps increasing across steps
    tokenizer = load_tokenizer(tiny_model_path)
    stop_ids = {tokenizer.convert_tokens_to_ids(s) for s in STOPS} | {tokenizer.eos_token_id}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    both = first.response_lengths.tolist() + second.response_lengths.tolist()
    assert len(set(both)) > 1  # uneven responses (16 of 8 tokens each: one in a thousand)
    for batch in (first, second):
        lengths = batch.response_lengths.tolist()
        per_group = batch.response_lengths.view(-1, 4).sum(dim=1)
        assert batch.prompt_mask_sums.tolist() == per_group.tolist()
        assert batch.sample_token_counts.tolist() == lengths
        for i in range(batch.num_samples):
            start, end = int(batch.prompt_lengths[i]), int(batch.sequence_lengths[i])
            span = torch.zeros(batch.input_ids.shape[1])
            span[start:end] = 1
            assert torch.equal(batch.loss_mask[i], span)  # exactly the response tokens
            assert torch.all(batch.rollout_log_probs[i][span == 0] == 0)
            prompt = tokenizer.decode(batch.input_ids[i, :start], skip_special_tokens=True)
            assert prompt.startswith("cp ") and prompt.endswith("=")
            response = batch.input_ids[i, start:end].tolist()
            if end - start < 8:  # ended early: on a stop token, which the mask includes
                assert response[-1] in stop_ids
                assert not stop_ids & set(response[:-1])
            with torch.no_grad():
                logits = model(input_ids=batch.input_ids[i : i + 1, :end]).logits[0]
            expected = logits[start - 1 : end - 1].float().log_softmax(-1)
            expected = expected.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
            assert torch.allclose(batch.rollout_log_probs[i, start:end], expected, atol=1e-5)
    for key in (
        "gen_tokens_per_s",
        "reward_mean",
        "reward_std",
        "response_length_mean",
        "reward_errors",
        "num_draws",
    ):
        assert f"rollout/{key}" in first.metadata
    assert first.metadata["rollout/gen_tokens"] == float(sum(first.response_lengths.tolist()))


def test_resume_continues_exactly(manager: ray.actor.ActorHandle) -> None:
    """From a state one prompt before the end of epoch 0 (set here, whatever ran before):
    step 2 takes that prompt and the first of epoch 1 (reshuffled), step 3 goes on in
    epoch 1; the same state loaded again gives both batches exactly."""
    state = ray.get(manager.state_dict.remote())
    num_prompts = state["cursor"]["num_items"]
    state["cursor"] |= {"epoch": 0, "position": num_prompts - 1}
    ray.get(manager.load_state_dict.remote(state))
    steps = [ray.get(manager.generate_batch.remote(step)) for step in (2, 3)]
    assert [batch.metadata["rollout/epoch"] for batch in steps] == [1.0, 1.0]
    assert ray.get(manager.state_dict.remote())["cursor"]["position"] == 3  # 1 + 2 of epoch 1
    ray.get(manager.load_state_dict.remote(state))
    for step, expected in zip((2, 3), steps, strict=True):
        _assert_same(ray.get(manager.generate_batch.remote(step)), expected)


def test_weight_update_through_the_object_store(
    manager: ray.actor.ActorHandle, tiny_model_path: str, other_tiny_model_path: str
) -> None:
    state = ray.get(manager.state_dict.remote())
    before = ray.get(manager.generate_batch.remote(7))
    weights_ref = ray.put(AutoModelForCausalLM.from_pretrained(other_tiny_model_path).state_dict())
    ray.get(manager.load_state_dict.remote(state))
    assert ray.get(manager.update_weights.remote([weights_ref])) == 1  # put once, by us
    after = ray.get(manager.generate_batch.remote(7))
    assert not torch.equal(before.input_ids, after.input_ids)  # same prompts, new samples
    assert after.metadata["rollout/weight_version"] == 1.0
    ray.get(manager.update_weights_from_disk.remote(tiny_model_path))
    ray.get(manager.load_state_dict.remote(state))
    _assert_same(ray.get(manager.generate_batch.remote(7)), before)


def _in_process_manager(config: dict, model_path: str) -> RolloutManager:
    base = {
        "engine": {"type": "torch", "num_engines": 1},
        "sampling": {"max_new_tokens": 4},
        "n_samples_per_prompt": 4,
        "global_batch_size": 8,
    }
    rollout = RolloutConfig.model_validate({**base, **config})
    actors = start_rollout_actors(rollout, model_path)
    try:
        return RolloutManager(rollout, model_path, engines=actors.engines, owns_engines=True,
                              teachers=actors.teachers, reward_actors=actors.reward_actors)
    except BaseException:
        actors.stop()
        raise


def test_dynamic_sampling_refills_the_batch(
    ray_cluster: None, tiny_model_path: str, tmp_path: Path
) -> None:
    # Every other record is "flat": its group scores all 0 and must be dropped.
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": f"cp {c}=", "label": c, "flat": i % 2 == 0} for i, c in enumerate("abcdefgh")
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    manager = _in_process_manager(
        {
            "dataset": {"type": "jsonl", "path": str(path), "shuffle": False},
            "reward": {
                "type": "custom",
                "custom_function": "tests.rollout.reward_fns:spread_unless_flat",
            },
            "sampling": {"max_new_tokens": 4, "temperature": 1.0},
            "dynamic_sampling": {"enabled": True, "max_draws": 6},
        },
        tiny_model_path,
    )
    try:
        batch = manager.generate_batch(0)
        assert batch.num_samples == 8 and batch.group_index.tolist() == [0] * 4 + [1] * 4
        assert batch.metadata["rollout/num_draws"] >= 2  # the first draw held a flat group
        assert batch.metadata["rollout/zero_spread_groups"] >= 1
        assert batch.metadata["rollout/zero_spread_filled"] == 0
        assert all(g.max() > g.min() for g in batch.rewards.view(2, 4))  # all have spread
        assert (batch.advantages != 0).any()
        assert manager.generate_batch(1).group_index.tolist() == [2] * 4 + [3] * 4
    finally:
        manager.shutdown()


def test_dynamic_sampling_fills_in_after_max_draws(ray_cluster: None, tiny_model_path: str) -> None:
    # The random model never copies correctly: every group is flat, every draw.
    manager = _in_process_manager(
        {"dynamic_sampling": {"enabled": True, "max_draws": 3}}, tiny_model_path
    )
    try:
        batch = manager.generate_batch(0)
        assert batch.num_samples == 8 and batch.num_prompts == 2
        assert batch.metadata["rollout/num_draws"] == 3.0
        assert batch.metadata["rollout/zero_spread_groups"] == 6.0
        assert batch.metadata["rollout/zero_spread_filled"] == 2.0
        assert batch.metadata["rollout/generated_samples"] == 24.0
    finally:
        manager.shutdown()


def test_construction_errors_need_no_actor(
    tiny_model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(
        DatasetError, match=f"dataset.path: {re.escape(str(missing))} does not exist"
    ):
        RolloutManager(RolloutConfig.model_validate({"dataset": {"type": "jsonl",
                                                                 "path": str(missing)}}),
                       tiny_model_path, engines=[], teachers=[], reward_actors={})
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None)  # no sglang
    with pytest.raises(EngineUnavailableError, match=r"engine\.type: 'sglang' launches"):
        RolloutManager(RolloutConfig(engine=SGLangEngineConfig()), tiny_model_path,
                       engines=[], teachers=[], reward_actors={})


def test_with_the_kl_in_the_reward_the_estimator_is_left_to_the_driver(
        tiny_model_path: str) -> None:
    from rollout.advantages import GRPO
    from tests.rollout.test_kl_reward import kl_case

    batch = kl_case(3).batch

    def advantages(estimator_in_driver: bool) -> torch.Tensor:
        manager = RolloutManager(RolloutConfig(), tiny_model_path, engines=[], teachers=[],
                                 reward_actors={}, estimator_in_driver=estimator_in_driver)
        return manager._with_advantages(batch).advantages

    assert torch.equal(advantages(False), GRPO().apply(batch).advantages)
    assert (GRPO().apply(batch).advantages != 0).any()
    assert torch.equal(advantages(True), batch.advantages)  # the driver adds GRPO's with β·k1
