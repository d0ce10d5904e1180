"""The token budget of a sample, in one place: the prompt, the response, each turn of an
episode, and a training session's ``sample``.

    C   the model's context: config.json's max_position_embeddings (n_positions for
        GPT-2-style configs); the built-in models' are known without building them
        (tiny 256, smollm2-135m-instruct 8192). None: the model says none, nothing is checked
    R   the response budget: rollout.sampling.max_new_tokens, or with an environment the
        episode's rollout.environment.max_total_tokens (actions and observations)
    P   the prompt budget: min(rollout.max_prompt_tokens, C − R)

    a job fits when  R < C  (room for a prompt of one token at least)
                and  max_prompt_tokens + R ≤ C  (when max_prompt_tokens is set)
    turn k of an episode that has used u of R and whose context holds c tokens:
        the policy may keep  min(sampling.max_new_tokens, R − u) ≥ 1  tokens, and the engine
        may generate at most  C − c  (a batch of episodes shares one max_new_tokens)
    a session sample:  len(prompt) + max_new_tokens ≤ C

``budget_problem`` is what ``tally validate``, the job's preflight and a REST submission
refuse (they all run services/runtime/preflight.py); the manager and the episode loop call
``prompt_budget`` and ``turn_tokens``, which raise instead of handing on a budget ≤ 0.
"""

from __future__ import annotations

import json
from pathlib import Path

from rollout.config import RolloutConfig
from rollout.pretrained import SMOLLM2_NAME
from rollout.problems import Problem

BUILTIN_CONTEXTS = {"tiny": 256, SMOLLM2_NAME: 8192}
"""The built-in models' contexts, so a config is checked before either is built (and
without importing transformers: rollout.tiny's TINY_ARCHITECTURE says 256, a test holds
them equal; SmolLM2's GGUF says llama.context_length 8192)."""
CONTEXT_KEYS = ("max_position_embeddings", "n_positions")


class TokenBudgetError(ValueError):
    """A budget that cannot fit the model's context; the message is ``field: numbers``."""


def model_context(model: str | Path) -> int | None:
    """C of a built-in model's name or of a model folder's config.json; None: unknown."""
    if str(model) in BUILTIN_CONTEXTS:
        return BUILTIN_CONTEXTS[str(model)]
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    for key in CONTEXT_KEYS:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def response_field(config: RolloutConfig) -> str:
    """The field that sets R."""
    if config.environment is not None:
        return "rollout.environment.max_total_tokens"
    return "rollout.sampling.max_new_tokens"


def budget_problem(config: RolloutConfig, context: int | None) -> str | None:
    """``field: numbers`` when R or max_prompt_tokens + R cannot fit C, else None."""
    if context is None:
        return None
    field, response = response_field(config), config.max_response_tokens
    if response >= context:
        relation = ">" if response > context else "="
        return (f"{field}: {response} {relation} the model's context {context}, leaving "
                f"no room for a prompt; set it below {context}")
    max_prompt = config.max_prompt_tokens
    if max_prompt is not None and max_prompt + response > context:
        return (f"rollout.max_prompt_tokens: {max_prompt} + "
                f"{field.removeprefix('rollout.')} {response} = {max_prompt + response} > "
                f"the model's context {context}; lower one of them")
    return None


def prompt_budget(config: RolloutConfig, context: int | None) -> int | None:
    """P = min(max_prompt_tokens, C − R), None when neither bounds it; TokenBudgetError
    when the config does not fit (the preflight refuses such a config first)."""
    problem = budget_problem(config, context)
    if problem is not None:
        raise TokenBudgetError(problem)
    budgets = [b for b in (config.max_prompt_tokens,
                           None if context is None else context - config.max_response_tokens)
               if b is not None]
    return min(budgets) if budgets else None


def turn_tokens(max_new_tokens: int, max_total_tokens: int, used: int) -> int:
    """min(sampling.max_new_tokens, R − u): what an episode's next turn may keep. An
    episode with nothing left has ended; asking for its turn is a bug, said as one."""
    left = min(max_new_tokens, max_total_tokens - used)
    if left <= 0:
        raise TokenBudgetError(
            f"rollout.environment.max_total_tokens: an episode has used {used} of "
            f"{max_total_tokens} tokens and has no turn left")
    return left


def sample_problem(prompt_field: str, num_prompt_tokens: int, max_new_tokens: int,
                   context: int | None) -> Problem | None:
    """The problem when a session's prompt plus sampling.max_new_tokens passes C."""
    if context is None or num_prompt_tokens + max_new_tokens <= context:
        return None
    if max_new_tokens >= context:
        return Problem("sampling.max_new_tokens", f"{max_new_tokens} leaves no room for a "
                       f"prompt in the model's context {context}")
    return Problem(prompt_field, f"{num_prompt_tokens} tokens + sampling.max_new_tokens "
                   f"{max_new_tokens} = {num_prompt_tokens + max_new_tokens} > the "
                   f"model's context {context}; shorten it to "
                   f"{context - max_new_tokens} tokens or lower max_new_tokens")
