"""Prompt length: ``rollout.max_prompt_tokens`` and the model's context.

    fit_prompt(ids, max_tokens, policy)  → ids, their last max_tokens (truncate_left), or
                                           None (drop); "error" raises naming the record

max_tokens is the prompt budget P of rollout/token_budget.py (max_prompt_tokens and what
the model's context leaves after the response budget). A prompt longer than the context,
or a generation budget past it, would run silently with positions the model never saw;
both are stopped before any actor starts (the preflight checks the budget) or, for a
prompt only the tokenizer can measure, at the first step that meets it, naming the record.
"""

from __future__ import annotations

from typing import Literal

Truncation = Literal["error", "truncate_left", "drop"]


class PromptTooLong(ValueError):
    """A prompt over rollout.max_prompt_tokens under prompt_truncation: error."""


def fit_prompt(ids: list[int], max_tokens: int | None, policy: Truncation, where: str
               ) -> list[int] | None:
    """The prompt as rollout feeds it: unchanged when it fits; else by ``policy``. A
    budget ≤ 0 is refused (ValueError): ``ids[-0:]`` would keep the whole prompt and a
    negative one a wrong slice; rollout/token_budget.py never hands one on."""
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"rollout.max_prompt_tokens: a prompt budget of {max_tokens} tokens "
                         f"fits no prompt ({where})")
    if max_tokens is None or len(ids) <= max_tokens:
        return ids
    if policy == "truncate_left":
        return ids[-max_tokens:]  # the end of a prompt is what the answer follows
    if policy == "drop":
        return None
    raise PromptTooLong(
        f"rollout.max_prompt_tokens: {where} has {len(ids)} prompt tokens, more than "
        f"{max_tokens}; raise it, or set rollout.prompt_truncation: truncate_left or drop")
