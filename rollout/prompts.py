"""Prompt length: ``rollout.max_prompt_tokens`` and the model's context.

    fit_prompt(ids, max_tokens, policy)  → ids, their last max_tokens (truncate_left), or
                                           None (drop); "error" raises naming the record
    context_problem(model_dir, …)        → why prompt + generation cannot fit the model's
                                           context (config.json max_position_embeddings)

A prompt longer than the context, or a generation budget past it, would run silently
with positions the model never saw; both are stopped before any actor starts (the
preflight) or, for a prompt only the tokenizer can measure, at the first step that meets
it, naming the record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rollout.config import EnvironmentConfig

Truncation = Literal["error", "truncate_left", "drop"]


class PromptTooLong(ValueError):
    """A prompt over rollout.max_prompt_tokens under prompt_truncation: error."""


def fit_prompt(ids: list[int], max_tokens: int | None, policy: Truncation, where: str
               ) -> list[int] | None:
    """The prompt as rollout feeds it: unchanged when it fits; else by ``policy``."""
    if max_tokens is None or len(ids) <= max_tokens:
        return ids
    if policy == "truncate_left":
        return ids[-max_tokens:]  # the end of a prompt is what the answer follows
    if policy == "drop":
        return None
    raise PromptTooLong(
        f"rollout.max_prompt_tokens: {where} has {len(ids)} prompt tokens, more than "
        f"{max_tokens}; raise it, or set rollout.prompt_truncation: truncate_left or drop")


def model_context(model_dir: str | Path) -> int | None:
    """The model's context length from its config.json, None when it says none."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def context_problem(model_dir: str | Path, max_prompt_tokens: int | None,
                    max_new_tokens: int, environment: EnvironmentConfig | None = None
                    ) -> str | None:
    """``field: message`` when the prompt budget plus the response budget exceeds the
    model's context, else None. The response budget is the generation budget, or with
    an ``environment`` its episode budget, max_total_tokens."""
    context = model_context(model_dir)
    if context is None:
        return None
    field, budget = "rollout.sampling.max_new_tokens", max_new_tokens
    if environment is not None:
        field, budget = "rollout.environment.max_total_tokens", environment.max_total_tokens
    if budget >= context:
        return (f"{field}: {budget} tokens do not fit the model's context of {context} "
                f"(max_position_embeddings) with any prompt")
    if max_prompt_tokens is not None and max_prompt_tokens + budget > context:
        return (f"rollout.max_prompt_tokens: {max_prompt_tokens} + "
                f"{field.removeprefix('rollout.')} {budget} = {max_prompt_tokens + budget} "
                f"tokens exceed the model's context of {context} (max_position_embeddings)")
    return None
