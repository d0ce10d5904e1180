"""rollout.max_prompt_tokens and the model's context: a long prompt is refused naming its
record, truncated from the left or dropped for the next one, and each step says how many;
a generation budget past the context is refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from rollout.config import RolloutConfig
from rollout.prompts import PromptTooLong, context_problem, fit_prompt
from rollout.tokenizer import encode_prompt, load_tokenizer


def test_fit_prompt_by_policy() -> None:
    ids = list(range(10))
    assert fit_prompt(ids, 10, "error", "record 3") == ids
    assert fit_prompt(ids, 4, "truncate_left", "record 3") == [6, 7, 8, 9]
    assert fit_prompt(ids, 4, "drop", "record 3") is None
    with pytest.raises(PromptTooLong, match=r"^rollout\.max_prompt_tokens: record 3 has 10 "
                                            r"prompt tokens, more than 4; raise it, or set "
                                            r"rollout\.prompt_truncation: truncate_left or"):
        fit_prompt(ids, 4, "error", "record 3")


def test_prompt_and_generation_must_fit_the_context(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    assert context_problem(tmp_path, 64, 64) is None
    assert context_problem(tmp_path, 100, 64) == (
        "rollout.max_prompt_tokens: 100 + sampling.max_new_tokens 64 = 164 tokens exceed the "
        "model's context of 128 (max_position_embeddings)")
    assert context_problem(tmp_path, None, 128).startswith(
        "rollout.sampling.max_new_tokens: 128 tokens do not fit the model's context of 128")
    assert context_problem(tmp_path / "none", 10**6, 10**6) is None  # says no context


def _config(tmp_path: Path, policy: str, max_prompt_tokens: int) -> RolloutConfig:
    data = tmp_path / "data.jsonl"
    lines = [{"prompt": "ab" * n, "label": "x"} for n in (1, 2, 20, 3)]  # record 2 is long
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return RolloutConfig.model_validate({
        "dataset": {"type": "jsonl", "path": str(data), "shuffle": False},
        "engine": {"type": "torch", "batch_size": 4}, "sampling": {"max_new_tokens": 2},
        "n_samples_per_prompt": 2, "global_batch_size": 4, "rollout_batch_size": 4,
        "max_prompt_tokens": max_prompt_tokens, "prompt_truncation": policy})


@pytest.mark.parametrize("policy", ["truncate_left", "drop", "error"])
def test_each_step_handles_and_counts_long_prompts(ray_cluster: None, tiny_model_path: str,
                                                   tmp_path: Path, policy: str) -> None:
    from rollout.manager import RolloutManagerActor

    tokenizer = load_tokenizer(tiny_model_path)
    lengths = [len(encode_prompt(tokenizer, "ab" * n, True)) for n in (1, 2, 20, 3)]
    limit = max(lengths[0], lengths[1], lengths[3])
    assert lengths[2] > limit
    manager = RolloutManagerActor.remote(_config(tmp_path, policy, limit), tiny_model_path)
    try:
        if policy == "error":
            with pytest.raises(ray.exceptions.RayTaskError, match="record 2 has "
                               f"{lengths[2]} prompt tokens, more than {limit}"):
                ray.get(manager.generate_batch.remote(0))
            return
        batch = ray.get(manager.generate_batch.remote(0))
        truncated = batch.metadata["rollout/prompts_truncated"]
        dropped = batch.metadata["rollout/prompts_dropped"]
        assert (truncated, dropped) == ((1.0, 0.0) if policy == "truncate_left" else (0.0, 1.0))
        prompt_lengths = (batch.sequence_lengths - batch.response_lengths).tolist()
        assert max(prompt_lengths) <= limit
        assert batch.num_samples == 8  # a dropped prompt was replaced by the next one
    finally:
        ray.get(manager.shutdown.remote())
        ray.kill(manager)
