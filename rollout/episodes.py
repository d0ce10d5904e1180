"""Multi-turn episodes: the policy acts, the environment answers, until it is done.

    record ─► env.reset ─► prompt ─► [policy turn ─► env.step ─► observation] × turns
                                        ▲ all live episodes generate together ┘

One episode is one sample: a single token sequence [prompt, action₁, observation₁,
action₂, …] whose loss mask is 1 on the action tokens only (the policy's), so every
aggregation mode's M_i and T_g count the policy's tokens and nothing the environment
wrote. The engine's log-probs come with the action tokens; observation tokens get 0.

A turn ends where the engine stops it (EOS, a stop string, sampling.max_new_tokens) or
at what is left of environment.max_total_tokens; after max_turns turns, after
``done``, or when the next observation does not fit, the episode ends. Its reward is the
sum of what ``step`` returned. Environment calls of a turn run concurrently (async ones
on one event loop, the others in threads), each bounded by step_timeout_s: a call that
raises, times out or returns something else than ``(observation, reward, done)`` ends
its episode with reward 0 and a failure message (the caller reports it), and no other
episode. A synchronous call past its timeout cannot be stopped; it keeps its thread until
it returns and its result is ignored. The threads are one pool per process of at most
MAX_ENV_THREADS, reused by every rollout, so a slow environment holds at most that many
(later calls wait for a free one, the wait counted in their timeout) instead of leaving
threads behind at each rollout.

Each turn's budget (rollout/token_budget.py): an episode that has used u of
max_total_tokens R keeps at most min(max_new_tokens, R − u) tokens of its action. The
engine gets one max_new_tokens per call, so a turn's episodes go in as few calls as the
model's context C allows: a call asks for the largest budget among its episodes, and
only holds episodes whose context has room for that many tokens (one call, unless the
context is nearly full).

The environment interface is in rollout/environments/__init__.py.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rollout.config import EnvironmentConfig
from rollout.engines.base import Generation
from rollout.environments import load_environment_class
from rollout.token_budget import episode_budget, turn_tokens
from rollout.turns import TurnFormat

Generate = Callable[[list[list[int]], int, int], list[Generation]]
"""(contexts, max_new_tokens, turn) -> one policy turn per context, in order."""

MAX_ENV_THREADS = 64
"""Threads for synchronous environment calls in one process, shared by every rollout."""
_threads: ThreadPoolExecutor | None = None
_threads_lock = threading.Lock()


def env_threads() -> ThreadPoolExecutor:
    """The process's one pool of environment threads (made on first use). Reused rather
    than made per rollout: a timed-out call's thread is then one of the pool's, never an
    extra one left running."""
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = ThreadPoolExecutor(MAX_ENV_THREADS, thread_name_prefix="tally-env")
        return _threads


class EnvironmentFailures(RuntimeError):
    """More episodes of one rollout failed than rollout.environment allows."""


@dataclass
class Episode:
    """One episode as it grows; a sample of the batch once it ends."""

    record: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    """1 on the policy's tokens, 0 on the environment's."""
    log_probs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    """(response position, reward) of each environment step: on the last token of the
    policy's action so far (where GAE credits it); they sum to ``reward``."""
    turns: int = 0
    """Policy turns taken."""
    observations: int = 0
    """Observations after the first the policy read (a tool's result, a game's reply)."""
    tool_calls: int | None = None
    """The environment's own count of tool calls (its ``tool_calls`` attribute when the
    episode ended), None when it keeps none."""
    env_done: bool = False
    """The environment said done (not a budget or max_turns)."""
    failure: str | None = None
    """``Class.method: what went wrong`` when the environment failed (reward 0)."""
    ended: bool = False
    env: Any = None

    @property
    def policy_tokens(self) -> int:
        return sum(self.response_mask)

    def place_reward(self, reward: float) -> None:
        """Credit an environment step's reward to the last token of the policy's action
        (an empty action: its last token before; none yet: nowhere to learn from)."""
        last = next((t for t in range(len(self.response_mask) - 1, -1, -1)
                     if self.response_mask[t]), None)
        if last is not None and reward:
            self.turn_rewards.append((last, reward))

    def end(self, failure: str | None = None) -> None:
        calls = getattr(self.env, "tool_calls", None)
        if isinstance(calls, int) and not isinstance(calls, bool):
            self.tool_calls = calls
        self.ended, self.env = True, None
        if failure is not None:
            self.failure, self.reward, self.turn_rewards = failure, 0.0, []

    def generation(self) -> Generation:
        """The response as one Generation: "stop" when the environment ended it."""
        return Generation(self.response_ids, self.log_probs,
                          "stop" if self.env_done else "length")


def run_episodes(records: list[dict[str, Any]], config: EnvironmentConfig, turns: TurnFormat,
                 generate: Generate, max_new_tokens: int,
                 fit_prompt: Callable[[list[int], int], list[int]],
                 context: int | None = None) -> tuple[list[Episode], float]:
    """(one episode per record, in order; a record repeated G times plays G episodes,
    the seconds spent waiting on the environment). ``fit_prompt(ids, i)``: the first
    observation's ids within the prompt budget (rollout.prompt_truncation; it raises for
    record i when that says error). ``context``: the model's C (None: unknown)."""
    env_class = load_environment_class(config.class_path)
    episodes = [Episode(record) for record in records]
    runner = _Calls(config.step_timeout_s, env_threads(), env_class.__name__)
    asyncio.run(_play(episodes, env_class, config, turns, generate, max_new_tokens,
                      fit_prompt, runner, context))
    return episodes, runner.seconds


def turn_calls(wants: list[int], caps: list[int]) -> list[tuple[int, list[int]]]:
    """A turn's engine calls as (max_new_tokens, episode indices): episode i keeps
    ``wants[i]`` tokens and may be generated up to ``caps[i]`` ≥ 1 tokens (its room in the
    context); a call asks for the largest want of its episodes, within each one's cap. A
    want past its cap (a prompt over its budget) is cut to the cap: asked for as it was,
    no call could hold it and the turn would never end."""
    if any(cap < 1 for cap in caps):
        raise ValueError(f"turn_calls: an episode without room in the context ({caps})")
    wants = [min(want, cap) for want, cap in zip(wants, caps, strict=True)]
    waiting = sorted(range(len(wants)), key=lambda i: -wants[i])
    calls = []
    while waiting:
        num_tokens = wants[waiting[0]]
        calls.append((num_tokens, sorted(i for i in waiting if caps[i] >= num_tokens)))
        waiting = [i for i in waiting if caps[i] < num_tokens]
    return calls


def _turn(live: list[Episode], generate: Generate, max_new_tokens: int, budget: float,
          context: int | None, turn: int) -> list[Generation]:
    """One policy turn of every live episode, in order, within each one's budget."""
    wants = [turn_tokens(max_new_tokens, budget, len(e.response_ids)) for e in live]
    # The prompt budget keeps prompt + R ≤ C, so a cap is below its want only for a prompt
    # over its budget (turn_calls cuts the want to it).
    caps = [max_new_tokens if context is None else
            min(max_new_tokens, context - len(e.prompt_ids) - len(e.response_ids))
            for e in live]
    actions: list[Generation | None] = [None] * len(live)
    for num_tokens, indices in turn_calls(wants, caps):
        answers = generate([live[i].prompt_ids + live[i].response_ids for i in indices],
                           num_tokens, turn)
        for i, answer in zip(indices, answers, strict=True):
            actions[i] = answer
    return [a for a in actions if a is not None]


async def _play(episodes: list[Episode], env_class: type, config: EnvironmentConfig,
                turns: TurnFormat, generate: Generate, max_new_tokens: int,
                fit_prompt: Callable[[list[int], int], list[int]], runner: _Calls,
                context: int | None) -> None:
    firsts = await runner.gather(runner.reset(env_class, config.kwargs, e.record)
                                 for e in episodes)
    for i, (episode, (env, observation, failure)) in enumerate(
            zip(episodes, firsts, strict=True)):
        if failure is not None:  # no prompt: one filler token each side, nothing counts
            episode.prompt_ids = episode.response_ids = [turns.filler_token]
            episode.response_mask, episode.log_probs = [0], [0.0]
            episode.end(failure)
            continue
        episode.env, episode.prompt_ids = env, fit_prompt(turns.first(observation), i)
    budget = episode_budget(config, context)  # unset: the model's context
    for turn in range(config.max_turns):
        for episode in episodes:  # a prompt over its budget can fill the context
            if not episode.ended and context is not None and context <= len(
                    episode.prompt_ids) + len(episode.response_ids):
                episode.end()
        live = [e for e in episodes if not e.ended]
        if not live:
            return
        actions = _turn(live, generate, max_new_tokens, budget, context, turn)
        texts = []
        for episode, action in zip(live, actions, strict=True):
            left = turn_tokens(max_new_tokens, budget, len(episode.response_ids))
            ids, log_probs = action.token_ids[:left], action.log_probs[:left]
            episode.response_ids += ids
            episode.response_mask += [1] * len(ids)
            episode.log_probs += log_probs
            episode.turns += 1
            texts.append(turns.tokenizer.decode(ids, skip_special_tokens=True))
        results = await runner.gather(runner.step(e.env, text)
                                      for e, text in zip(live, texts, strict=True))
        last_turn = turn + 1 == config.max_turns
        for episode, action, (observation, reward, done, failure) in zip(
                live, actions, results, strict=True):
            if failure is not None:
                episode.end(failure)
                continue
            episode.reward += reward
            episode.place_reward(reward)
            if done or observation is None:
                episode.env_done = True
                episode.end()
                continue
            appended = turns.later(observation, action.token_ids)
            used = len(episode.response_ids) + len(appended)
            if last_turn or used >= budget or (
                    context is not None and len(episode.prompt_ids) + used >= context):
                episode.end()  # no turn left to read it, or no room for one after it
                continue
            episode.response_ids += appended
            episode.response_mask += [0] * len(appended)
            episode.log_probs += [0.0] * len(appended)
            episode.observations += 1


class _Calls:
    """Environment calls with the step timeout; each returns its failure, never raises."""

    def __init__(self, timeout_s: float, threads: ThreadPoolExecutor, name: str) -> None:
        self.timeout_s, self.threads, self.name = timeout_s, threads, name
        self.seconds = 0.0
        """Wall-clock time spent waiting on environment calls (concurrent calls once)."""

    async def gather(self, calls: Iterable[Awaitable[Any]]) -> list[Any]:
        """The calls' results, run concurrently; their wall time counts once."""
        start = time.perf_counter()
        try:
            return list(await asyncio.gather(*calls))
        finally:
            self.seconds += time.perf_counter() - start

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            pending = fn(*args)
        else:
            pending = asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)
        result = await asyncio.wait_for(pending, self.timeout_s)
        if inspect.isawaitable(result):  # a plain function that returned a coroutine
            result = await asyncio.wait_for(result, self.timeout_s)
        return result

    def _failure(self, method: str, err: BaseException) -> str:
        if isinstance(err, TimeoutError):
            return (f"{self.name}.{method}: no answer within rollout.environment."
                    f"step_timeout_s={self.timeout_s:g} s")
        said = " ".join(str(err).split())
        return f"{self.name}.{method}: {type(err).__name__}{': ' + said if said else ''}"

    async def reset(self, env_class: type, kwargs: dict[str, Any], record: dict[str, Any]
                    ) -> tuple[Any, str, str | None]:
        """(env, first observation, None), or (None, "", failure)."""
        method = "__init__"
        try:
            env = await self._call(lambda: env_class(**kwargs))
            method = "reset"
            observation = await self._call(env.reset, record)
        except Exception as err:  # the user's code: any exception ends this episode only
            return None, "", self._failure(method, err)
        if not isinstance(observation, str) or not observation:
            return None, "", (f"{self.name}.reset: returned {_short(observation)}, expected "
                              "the first observation (a non-empty str)")
        return env, observation, None

    async def step(self, env: Any, action: str
                   ) -> tuple[str | None, float, bool, str | None]:
        """(observation, reward, done, None), or (None, 0, True, failure)."""
        try:
            result = await self._call(env.step, action)
        except Exception as err:
            return None, 0.0, True, self._failure("step", err)
        try:
            observation, reward, done = result
            reward = float(reward)
        except (TypeError, ValueError):
            reward = math.nan
        if math.isnan(reward) or math.isinf(reward) or not (
                observation is None or isinstance(observation, str)):
            return None, 0.0, True, (f"{self.name}.step: returned {_short(result)}, expected "
                                     "(observation: str | None, reward: float, done: bool)")
        return observation, reward, bool(done), None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


