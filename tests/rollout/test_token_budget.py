"""rollout/token_budget.py in numbers: the model's context C for built-in and folder
models, the prompt budget P = min(max_prompt_tokens, C − R), the refusals naming the
field, each turn's budget and how a turn's episodes share engine calls, a session's
sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.config import RolloutConfig
from rollout.episodes import turn_calls
from rollout.problems import Problem
from rollout.tiny import TINY_ARCHITECTURE
from rollout.token_budget import (
    UNKNOWN_CONTEXT,
    TokenBudgetError,
    budget_problem,
    episode_budget,
    model_context,
    prompt_budget,
    response_budget,
    sample_problem,
    turn_tokens,
)

ENV = {"class_path": "rollout.environments.guess_number:GuessNumber"}


def rollout(**fields: object) -> RolloutConfig:
    return RolloutConfig.model_validate(fields)


def test_the_context_of_built_in_and_folder_models(tmp_path: Path) -> None:
    assert model_context("tiny") == TINY_ARCHITECTURE["max_position_embeddings"] == 256
    assert model_context("smollm2-135m-instruct") == 8192
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    assert model_context(tmp_path) == 128
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 1024}))  # GPT-2 style
    assert model_context(tmp_path) == 1024
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": True}))
    assert model_context(tmp_path) is None
    assert model_context(tmp_path / "none") is None  # says no context: nothing checked


def test_the_prompt_budget_is_what_the_context_leaves() -> None:
    assert prompt_budget(rollout(sampling={"max_new_tokens": 64}), 256) == 192
    assert prompt_budget(rollout(sampling={"max_new_tokens": 64}, max_prompt_tokens=100),
                         256) == 100
    assert prompt_budget(rollout(environment={**ENV, "max_total_tokens": 200},
                                 sampling={"max_new_tokens": 64}), 256) == 56
    assert prompt_budget(rollout(max_prompt_tokens=100), None) == 100
    assert prompt_budget(rollout(), None) is None


def test_a_budget_past_the_context_names_the_field_and_the_numbers() -> None:
    over = rollout(environment={**ENV, "max_total_tokens": 512})  # an explicit one
    said = ("rollout.environment.max_total_tokens: 512 > the model's context 256, leaving "
            "no room for a prompt; set it below 256")
    assert budget_problem(over, 256) == said
    with pytest.raises(TokenBudgetError, match="^" + said.replace(".", r"\.") + "$"):
        prompt_budget(over, 256)  # never a negative budget handed on
    assert budget_problem(rollout(sampling={"max_new_tokens": 256}), 256) == (
        "rollout.sampling.max_new_tokens: 256 = the model's context 256, leaving no room "
        "for a prompt; set it below 256")
    assert budget_problem(rollout(sampling={"max_new_tokens": 64}, max_prompt_tokens=200),
                          256) == (
        "rollout.max_prompt_tokens: 200 + sampling.max_new_tokens 64 = 264 > the model's "
        "context 256; lower one of them")
    assert budget_problem(rollout(sampling={"max_new_tokens": 64}, max_prompt_tokens=192),
                          256) is None
    assert budget_problem(over, 8192) is None and budget_problem(over, None) is None


def test_an_unset_episode_budget_is_the_models_context() -> None:
    """environment.max_total_tokens unset (the default) fits the demo model as it is: R is
    the model's context (the constant mode's max_response_len), the prompt keeps room
    for one whole turn, and an episode may fill what its prompt leaves; a context nobody
    states is refused naming the field, and an explicit budget is still honoured."""
    default = rollout(environment=ENV, sampling={"max_new_tokens": 64})
    assert default.environment is not None and default.environment.max_total_tokens is None
    assert budget_problem(default, 256) is None
    assert response_budget(default, 256) == 256 and response_budget(default, 8192) == 8192
    assert prompt_budget(default, 256) == 256 - 64
    assert prompt_budget(rollout(environment=ENV, max_prompt_tokens=100), 256) == 100
    assert episode_budget(default.environment, 256) == 256
    assert turn_tokens(64, episode_budget(default.environment, 256), 250) == 6
    assert budget_problem(rollout(environment=ENV, sampling={"max_new_tokens": 256}), 256) == (
        "rollout.sampling.max_new_tokens: 256 = the model's context 256, leaving no room "
        "for a prompt; set it below 256")
    assert budget_problem(default, None) == UNKNOWN_CONTEXT
    assert UNKNOWN_CONTEXT.startswith("rollout.environment.max_total_tokens: ")
    with pytest.raises(TokenBudgetError, match="does not state"):
        response_budget(default, None)
    with pytest.raises(TokenBudgetError, match="does not state"):
        prompt_budget(default, None)
    explicit = rollout(environment={**ENV, "max_total_tokens": 100})
    assert explicit.environment is not None
    assert response_budget(explicit, 256) == episode_budget(explicit.environment, 256) == 100
    assert response_budget(explicit, None) == 100 and budget_problem(explicit, None) is None
    assert response_budget(rollout(sampling={"max_new_tokens": 64}), None) == 64


def test_a_turn_keeps_what_its_episode_has_left() -> None:
    assert turn_tokens(12, 160, 0) == 12
    assert turn_tokens(12, 160, 150) == 10
    assert turn_tokens(12, 160, 159) == 1
    with pytest.raises(TokenBudgetError, match=r"^rollout\.environment\.max_total_tokens: "
                                               r"an episode has used 160 of 160 tokens"):
        turn_tokens(12, 160, 160)


def test_a_turn_shares_engine_calls_as_the_context_allows() -> None:
    # room in the context for all: one call at the largest budget, as before
    assert turn_calls([12, 3, 12], [12, 12, 12]) == [(12, [0, 1, 2])]
    # episode 1 may keep 3 and its context holds only 3 more: a call of its own
    assert turn_calls([12, 3, 12, 1], [12, 3, 12, 12]) == [(12, [0, 2, 3]), (3, [1])]
    assert turn_calls([5, 4, 3], [5, 4, 3]) == [(5, [0]), (4, [1]), (3, [2])]
    assert turn_calls([], []) == []


def test_a_want_past_its_cap_is_cut_to_it() -> None:
    """A prompt over its budget leaves an episode less room than it may keep: its call
    asks for the room, once (this looped forever when the want was asked for)."""
    assert turn_calls([12], [5]) == [(5, [0])]
    assert turn_calls([12, 12, 3], [5, 12, 12]) == [(12, [1, 2]), (5, [0])]
    with pytest.raises(ValueError, match="without room in the context"):
        turn_calls([4], [0])


def test_a_session_sample_must_fit_the_context() -> None:
    assert sample_problem("prompt_tokens[0]", 200, 56, 256) is None
    assert sample_problem("prompt_tokens[1]", 200, 64, 256) == Problem(
        "prompt_tokens[1]", "200 tokens + sampling.max_new_tokens 64 = 264 > the model's "
                            "context 256; shorten it to 192 tokens or lower max_new_tokens")
    assert sample_problem("prompt_tokens[0]", 1, 256, 256) == Problem(
        "sampling.max_new_tokens", "256 leaves no room for a prompt in the model's "
                                   "context 256")
    assert sample_problem("prompt_tokens[0]", 10**6, 10**6, None) is None
