"""Episode rollouts: one episode of rollout.environment per request (rollout/episodes.py),
scored by the environment.

    request ─► env.reset ─► [policy turn on the engines ─► env.step] × turns ─► Sample

Turn 0 of a play is seeded with the play's own key, turn t > 0 with ``<key>:turn<t>``;
each call tells the engines which set of episodes and which turn it plays
(rollout/engines/base.EpisodeTurn) so they may keep the KV of the turn before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rollout.config import EnvironmentConfig
from rollout.engines.base import EpisodeTurn, Generation
from rollout.episodes import EnvironmentFailures, Episode, run_episodes
from rollout.prompts import Truncation, fit_prompt
from rollout.rollouts.base import Generate, Play, Played, Request, Rollout, Sample, StepStats
from rollout.tokenizer import decode_responses
from rollout.turns import TurnFormat


class Episodic(Rollout):
    """Multi-turn episodes of an environment; each is one sample."""

    writes_prompts = True

    def __init__(self, config: EnvironmentConfig, turns: TurnFormat, generate: Generate,
                 max_prompt_tokens: int, truncation: Truncation, context: int | None) -> None:
        self.config, self.turns, self.generate = config, turns, generate
        self.max_prompt_tokens, self.truncation = max_prompt_tokens, truncation
        self.context = context

    def play(self, plays: list[Play], training: bool) -> Played:
        played = Played([])
        for play in plays:
            started = time.perf_counter()
            episodes, env_seconds = self._episodes(play)
            played.gen_time_s += time.perf_counter() - started - env_seconds
            played.env_seconds += env_seconds
            played.episodes += episodes
            texts = decode_responses(self.turns.tokenizer, [e.response_ids for e in episodes])
            played.samples += [
                Sample(r.record, e.prompt_ids, e.generation(), e.reward, text,
                       mask=e.response_mask, turn_rewards=e.turn_rewards,
                       truncated=cut_short(e))
                for r, e, text in zip(play.requests, episodes, texts, strict=True)]
        return played

    def _episodes(self, play: Play) -> tuple[list[Episode], float]:
        """One episode per request on the engines, every live one generating each turn."""
        requests, sampling, key, draw = play.requests, play.sampling, play.key, play.draw

        def generate(contexts: list[list[int]], max_new_tokens: int, turn: int
                     ) -> list[Generation]:
            turn_sampling = sampling.model_copy(update={"max_new_tokens": max_new_tokens})
            episode_turn = EpisodeTurn(f"{key}:{draw}", turn, turn + 1 == self.config.max_turns)
            return self.generate(contexts, turn_sampling,
                                 key if turn == 0 else f"{key}:turn{turn}", draw, episode_turn)

        return run_episodes([_record(r) for r in requests], self.config, self.turns, generate,
                            sampling.max_new_tokens, self._fit(requests), self.context)

    def _fit(self, requests: list[Request]) -> Callable[[list[int], int], list[int]]:
        """run_episodes' ``fit_prompt``: a first observation within the prompt budget."""

        def fit(ids: list[int], i: int) -> list[int]:
            fitted = fit_prompt(ids, self.max_prompt_tokens, self.truncation,
                                f"the first observation of record {requests[i].number}")
            assert fitted is not None  # "drop" is refused with an environment
            return fitted

        return fit

    def finish(self, stats: StepStats, step: int
               ) -> tuple[dict[str, float], list[tuple[str, str]]]:
        """The step's environment metrics, and one ``environment_failed`` event per failed
        episode; past max_failures_per_rollout, EnvironmentFailures (the job stops)."""
        failed = [e.failure for e in stats.episodes if e.failure is not None]
        if len(failed) > self.config.max_failures_per_rollout:
            raise EnvironmentFailures(
                f"rollout.environment.max_failures_per_rollout: {len(failed)} episodes of "
                f"rollout step {step} failed in {self.config.class_path}, above "
                f"{self.config.max_failures_per_rollout}; first: {failed[0]}")
        events = [("environment_failed", f"rollout step {step}: {self.config.class_path}: "
                   f"{failure}; the episode ends with reward 0") for failure in failed]
        return environment_metrics(stats), events


def cut_short(episode: Episode) -> bool:
    """The episode was cut at a limit: it ended without its environment saying done
    (its token budget, the model's context, max_turns, or a next observation with no
    room left) and without failing. A failed episode ends with reward 0 by rule
    (rollout/episodes.py), an outcome of its own, not a cut for GAE to bootstrap."""
    return not episode.env_done and episode.failure is None


def _record(request: Request) -> dict:
    """What the environment's reset reads of a record."""
    record = request.record
    return {"prompt": record.prompt, "label": record.label, "metadata": dict(record.metadata)}


def environment_metrics(stats: StepStats) -> dict[str, float]:
    """Per episode: turns, observations read and, where the environment counts them
    (a ``tool_calls`` attribute), tool calls; per rollout: the seconds spent in the
    environment, failures, and the policy's share of the response tokens."""
    episodes = stats.episodes
    if not episodes:
        return {}
    response_tokens = sum(len(e.response_ids) for e in episodes)
    counted = [e.tool_calls for e in episodes if e.tool_calls is not None]
    return {
        **({"env/tool_calls_mean": _mean(counted)} if counted else {}),
        "env/turns_mean": _mean([e.turns for e in episodes]),
        "env/observations_mean": _mean([e.observations for e in episodes]),
        "env/seconds": stats.env_seconds,
        "env/failures": float(sum(e.failure is not None for e in episodes)),
        "env/done_fraction": _mean([e.env_done for e in episodes]),
        "env/policy_token_share": (sum(e.policy_tokens for e in episodes)
                                   / max(response_tokens, 1)),
    }


def _mean(values: list[int] | list[bool]) -> float:
    return float(sum(values) / len(values)) if values else 0.0

