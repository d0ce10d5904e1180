"""The token budget of a sample, in one place: the prompt, the response, each turn of an
episode, and a training session's ``sample``.

    C   the model's context: config.json's max_position_embeddings (n_positions for
        GPT-2-style configs); the built-in models' are known without building them
        (tiny 256, smollm2-135m-instruct 8192). None: the model says none, nothing is checked
    R   the response budget: rollout.sampling.max_new_tokens, or with an environment the
        episode's rollout.environment.max_total_tokens (actions and observations); that
        one unset (the default): C itself, the episode filling what its prompt leaves
    P   the prompt budget: min(rollout.max_prompt_tokens, C − R); with R left to the
        context, C − sampling.max_new_tokens (room for one whole turn)

    a job fits when  R < C  (room for a prompt of one token at least)
                and  max_prompt_tokens + R ≤ C  (when max_prompt_tokens is set)
    (R left to the context: the same, of sampling.max_new_tokens; C must be known)
    turn k of an episode that has used u of R and whose context holds c tokens:
        the policy may keep  min(sampling.max_new_tokens, R − u) ≥ 1  tokens, and the engine
        may generate at most  C − c  (a batch of episodes shares one max_new_tokens)
    a session sample:  len(prompt) + max_new_tokens ≤ C
    a judge's prompt J (its template filled in, under its chat template, in its tokens):
        J ≤ min(max_prompt_tokens, C_judge − max_new_tokens); either may be unknown
        (a judge on a server: no C_judge); a longer one has its response cut
        (rollout/judge.fit_requests), never the instructions, question or label

``budget_problem`` is what ``tally validate``, the job's preflight and a REST submission
refuse (they all run services/runtime/preflight.py); the manager and the episode loop call
``prompt_budget`` and ``turn_tokens``, which raise instead of handing on a budget ≤ 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rollout.config import EnvironmentConfig, RolloutConfig
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


EPISODE_FIELD = "rollout.environment.max_total_tokens"
UNKNOWN_CONTEXT = (f"{EPISODE_FIELD}: unset, it is the model's context, which the model "
                   "does not state (no max_position_embeddings or n_positions in its "
                   "config.json); set it")
"""Why an episode budget left to the context cannot be resolved."""


def _left_to_context(config: RolloutConfig) -> bool:
    """An environment whose max_total_tokens is unset: R is the model's context."""
    return config.environment is not None and config.environment.max_total_tokens is None


def _reserved(config: RolloutConfig) -> tuple[str, int]:
    """(field, tokens) the prompt budget leaves room for after a prompt: R, or one whole
    turn (sampling.max_new_tokens) when R is left to the context."""
    if config.environment is not None and config.environment.max_total_tokens is not None:
        return EPISODE_FIELD, config.environment.max_total_tokens
    return "rollout.sampling.max_new_tokens", config.sampling.max_new_tokens


def response_budget(config: RolloutConfig, context: int | None) -> int:
    """R as a number (the constant mode's max_response_len): the configured budget, or C
    for an episode budget left to the context (TokenBudgetError when C is unknown)."""
    if config.max_response_tokens is not None:
        return config.max_response_tokens
    if context is None:
        raise TokenBudgetError(UNKNOWN_CONTEXT)
    return context


def episode_budget(config: EnvironmentConfig, context: int | None) -> float:
    """R of one episode: max_total_tokens, or C when unset (then the context, not R, ends
    the episode: each turn is capped by the room its context has left); unset with no
    known C (a caller playing without one; a job's preflight refuses it): no bound but
    max_turns, ``math.inf``."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    return math.inf if context is None else context


def budget_problem(config: RolloutConfig, context: int | None) -> str | None:
    """``field: numbers`` when R or max_prompt_tokens + R cannot fit C, else None."""
    if context is None:
        return UNKNOWN_CONTEXT if _left_to_context(config) else None
    field, response = _reserved(config)
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
                           None if context is None else context - _reserved(config)[1])
               if b is not None]
    return min(budgets) if budgets else None


def turn_tokens(max_new_tokens: int, max_total_tokens: float, used: int) -> int:
    """min(sampling.max_new_tokens, R − u): what an episode's next turn may keep. An
    episode with nothing left has ended; asking for its turn is a bug, said as one."""
    left = int(min(max_new_tokens, max_total_tokens - used))
    if left <= 0:
        raise TokenBudgetError(
            f"{EPISODE_FIELD}: an episode has used {used} of "
            f"{max_total_tokens} tokens and has no turn left")
    return left


def config_context(config: object) -> int | None:
    """C of a loaded model's config object (its first of CONTEXT_KEYS); None: unknown."""
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def judge_prompt_budget(context: int | None, max_new_tokens: int,
                        max_prompt_tokens: int | None) -> int | None:
    """J's bound, min(max_prompt_tokens, C − max_new_tokens) of what is known; None:
    neither is. TokenBudgetError when the judge's answer alone fills its context."""
    budgets = [] if max_prompt_tokens is None else [max_prompt_tokens]
    if context is not None:
        if max_new_tokens >= context:
            raise TokenBudgetError(f"max_new_tokens: {max_new_tokens} leaves no room for "
                                   f"a prompt in the judge's context {context}")
        budgets.append(context - max_new_tokens)
    return min(budgets) if budgets else None


def judge_problem(context: int | None, max_new_tokens: int,
                  max_prompt_tokens: int | None) -> str | None:
    """``field: numbers`` (fields of the judge's block) when its answer or its
    max_prompt_tokens + max_new_tokens cannot fit the judge's context C, else None."""
    try:
        judge_prompt_budget(context, max_new_tokens, max_prompt_tokens)
    except TokenBudgetError as err:
        return str(err)
    if context is not None and max_prompt_tokens is not None \
            and max_prompt_tokens + max_new_tokens > context:
        return (f"max_prompt_tokens: {max_prompt_tokens} + max_new_tokens {max_new_tokens}"
                f" = {max_prompt_tokens + max_new_tokens} > the judge's context {context};"
                " lower one of them")
    return None


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
