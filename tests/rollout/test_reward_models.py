"""Rewards beyond rules on a real Ray cluster: reward models (random-initialised, one with
the policy's tokenizer, one with its own tokenizer and chat template) and weighted parts.
What the manager logs as text is scored again here with transformers alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rollout.config import RolloutConfig
from rollout.manager import RolloutManagerActor
from rollout.reward_parts import RunningMoments
from services.runtime.gang import start_rollout_actors
from tests.reward_model_folders import save_random_reward_model


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: str,
                  smollm2_path: Path) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("rms")
    return (save_random_reward_model(root / "tiny-rm", tiny_model_path, seed=1),
            save_random_reward_model(root / "chat-rm", str(smollm2_path), seed=2))


def _config(tiny_rm: str, chat_rm: str) -> RolloutConfig:
    return RolloutConfig.model_validate({
        "dataset": {"type": "synthetic", "task": "copy", "num_prompts": 6, "seed": 1},
        "sampling": {"max_new_tokens": 6},
        "n_samples_per_prompt": 4, "global_batch_size": 8, "seed": 3,
        "reward": [
            {"type": "exact_match", "weight": 0.5},
            {"type": "model", "name": "rm", "path": tiny_rm, "weight": 2.0, "num_cpus": 0,
             "batch_size": 3},
            {"type": "model", "name": "chat_rm", "path": chat_rm, "chat_template": True,
             "weight": -1.0, "num_cpus": 0, "num_actors": 2},
            {"type": "model", "name": "rm_norm", "path": tiny_rm, "normalize": True,
             "weight": 0.25, "num_cpus": 0},
        ]})


@pytest.fixture(scope="module")
def manager(ray_cluster: None, tiny_model_path: str, reward_models: tuple[str, str]
            ) -> Iterator[ray.actor.ActorHandle]:
    config = _config(*reward_models)
    actors = start_rollout_actors(config, tiny_model_path)
    actor = RolloutManagerActor.remote(config, tiny_model_path, engines=actors.engines,
                                       owns_engines=True, teachers=actors.teachers,
                                       reward_actors=actors.reward_actors, samples_per_step=8)
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


def _transformers_score(folder: str, ids: list[int]) -> float:
    """transformers' forward of ``ids`` alone, read at the last id (no pad token in the
    config: transformers then reads the last token)."""
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    model.config.pad_token_id = None
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


@pytest.mark.slow  # a manager, its engine and four reward actors on Ray
def test_logged_rewards_are_transformers_scores_of_the_logged_text(
        manager: ray.actor.ActorHandle, reward_models: tuple[str, str]) -> None:
    tiny_rm, chat_rm = reward_models
    chat_tokenizer = AutoTokenizer.from_pretrained(chat_rm)
    tiny_tokenizer = AutoTokenizer.from_pretrained(tiny_rm)
    batch = ray.get(manager.generate_batch.remote(0))
    samples = batch.samples
    assert len(samples) == 8 and [s.index for s in samples] == list(range(8))
    moments = RunningMoments()
    moments.update([s.rewards["rm"] for s in samples])
    for sample in samples:
        rewards = sample.rewards
        # no template: the record's prompt and the response, one BOS (the policy's
        # prompt text already starts with one: it is not what is scored)
        plain = list(tiny_tokenizer(sample.record_prompt + sample.response)["input_ids"])
        assert plain.count(tiny_tokenizer.bos_token_id) == 1
        assert rewards["rm"] == pytest.approx(_transformers_score(tiny_rm, plain), abs=1e-4)
        chat_ids = chat_tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.record_prompt},
             {"role": "assistant", "content": sample.response}], tokenize=True)["input_ids"]
        assert rewards["chat_rm"] == pytest.approx(_transformers_score(chat_rm, chat_ids),
                                                   abs=1e-4)
        assert rewards["exact_match"] == float(
            sample.response.strip() == sample.label.strip())
        # the normalised part: the same RM's scores, standardised by this rollout's
        assert rewards["rm_norm"] == pytest.approx(
            (rewards["rm"] - moments.mean) / moments.std, abs=1e-6)
        # the weights combine exactly: r = Σ w_k r_k, in the parts' order
        assert sample.reward == (0.5 * rewards["exact_match"] + 2.0 * rewards["rm"]
                                    - 1.0 * rewards["chat_rm"] + 0.25 * rewards["rm_norm"])
        assert batch.rewards[sample.index] == torch.tensor(sample.reward)
    assert len({round(s.rewards["chat_rm"], 6) for s in samples}) > 1  # not constant
    parts = [s.rewards["rm"] for s in samples]
    assert batch.metadata["reward/rm/mean"] == pytest.approx(sum(parts) / len(parts))
    assert batch.metadata["reward/chat_rm/std"] > 0
    assert batch.metadata["perf/reward_busy_s"] > 0
    assert batch.metadata["reward/rm/truncated"] == 0  # every text fits the RM's context


@pytest.mark.slow
def test_running_normalisation_is_saved_and_restored(manager: ray.actor.ActorHandle
                                                     ) -> None:
    ray.get(manager.generate_batch.remote(0))  # some scores seen, whatever ran before
    state = ray.get(manager.state_dict.remote())
    count, mean, _ = state["rewards"]["rm_norm"]
    assert count >= 8 and mean != 0.0
    after = ray.get(manager.generate_batch.remote(1))
    ray.get(manager.load_state_dict.remote(state))
    again = ray.get(manager.generate_batch.remote(1))
    assert [s.rewards for s in again.samples] == [s.rewards for s in after.samples]


def test_running_moments_merge_equals_one_pass() -> None:
    values = torch.randn(37, dtype=torch.float64).tolist()
    merged = RunningMoments()
    for chunk in (values[:5], values[5:6], values[6:]):
        merged.update(chunk)
    assert merged.count == 37
    exact = torch.tensor(values, dtype=torch.float64)
    assert merged.mean == pytest.approx(float(exact.mean()), rel=1e-12)
    assert merged.std == pytest.approx(float(exact.std()), rel=1e-12)
