"""rollout.max_prompt_tokens and the model's context: a long prompt is refused naming its
record, truncated from the left or dropped for the next one, and each step says how many;
a budget of no tokens is refused (tests/rollout/test_token_budget.py has the context)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from rollout.config import RolloutConfig
from rollout.prompts import PromptTooLong, fit_prompt
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


def test_a_budget_of_no_tokens_is_refused_not_sliced() -> None:
    """ids[-0:] is the whole prompt and ids[-(-3):] its end past 3: neither is a fit."""
    for budget in (0, -256):
        for policy in ("error", "truncate_left", "drop"):
            with pytest.raises(ValueError, match=rf"^rollout\.max_prompt_tokens: a prompt "
                                                 rf"budget of {budget} tokens fits no prompt "
                                                 r"\(record 3\)$"):
                fit_prompt([1, 2, 3], budget, policy, "record 3")


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
    from services.runtime.gang import start_rollout_actors

    tokenizer = load_tokenizer(tiny_model_path)
    lengths = [len(encode_prompt(tokenizer, "ab" * n, True)) for n in (1, 2, 20, 3)]
    limit = max(lengths[0], lengths[1], lengths[3])
    assert lengths[2] > limit
    config = _config(tmp_path, policy, limit)
    actors = start_rollout_actors(config, tiny_model_path)
    manager = RolloutManagerActor.remote(config, tiny_model_path, engines=actors.engines,
                                         owns_engines=True, teachers=actors.teachers,
                                         reward_actors=actors.reward_actors)
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
