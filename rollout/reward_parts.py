"""The reward of a sample from its parts: rules here, reward models and judges in actors.

    r = Σ_k weight_k · r_k        (one part: r = weight · r_1)

A model part's score may be normalised, r_k = (s − μ) / σ, with μ, σ the running mean
and std of every raw score so far (this rollout's included; Chan's merge of (n, mean,
M2), kept in the manager's state so a resume continues them). A judge's unparsed answer
is 0 and counted. The manager asks for a shard's scores as soon as its responses are
generated (:meth:`Rewarder.submit`: the actors work while other engines still
generate), and combines them once all shards are in (:meth:`Rewarder.collect`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from rollout.judge import JudgeEngine, ask_server, judge_request, parse_score
from rollout.reward_config import (
    JudgeConfig,
    RewardConfig,
    RewardModelConfig,
    served_in_gang,
)
from rollout.reward_model import RewardModel
from rollout.rewards import RewardScorer
from rollout.shards import shard_bounds


@dataclass
class RunningMoments:
    """Count, mean and M2 (Σ (x − mean)²) of every score seen."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, values: list[float]) -> None:
        if not values:
            return
        n = len(values)
        mean = sum(values) / n
        m2 = sum((v - mean) ** 2 for v in values)
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def normalize(self, values: list[float]) -> list[float]:
        scale = max(self.std, 1e-6)
        return [(v - self.mean) / scale for v in values]


@dataclass
class RewardScores:
    """A batch's rewards: the weighted total, each part's values, what went wrong."""

    total: list[float]
    parts: dict[str, list[float]]
    errors: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    """Rule part -> (samples whose rule raised, the first error)."""
    unparsed: dict[str, int] = field(default_factory=dict)
    """Judge part -> answers that did not parse."""
    busy_s: float = 0.0
    """Seconds the reward actors (and a judge server) spent on this batch."""


@dataclass
class _Pending:
    """One shard's scores asked for: a rule's values, an actor's refs, a server's future."""

    size: int
    rules: dict[str, Any] = field(default_factory=dict)
    refs: dict[str, list[Any]] = field(default_factory=dict)
    futures: dict[str, Future] = field(default_factory=dict)


def _shards(num_items: int, num_shards: int) -> list[tuple[int, int]]:
    return [(a, b) for a, b in shard_bounds(num_items, num_shards) if b > a]


def start_reward_actors(parts: list[Any], resolve: Callable[[str], str],
                        placement: list[dict[str, Any]] | None = None
                        ) -> dict[str, list[Any]]:
    """The actors of every model part and every judge without a url, started (not waited
    for), in part order; ``placement``: per-actor Ray options in the same order
    (rollout/reward_config.reward_actor_bundles'); ``resolve``: a judge's model name to
    its folder."""
    from rollout.config import TorchEngineConfig

    options = iter(placement or [])
    actors: dict[str, list[Any]] = {}
    for part in parts:
        if isinstance(part, RewardModelConfig):
            part = part.model_copy(update={  # a worker's cwd may not be the caller's
                "path": str(Path(part.path).expanduser().resolve()),
                "tokenizer": part.tokenizer and str(Path(part.tokenizer).expanduser().resolve())})
            actor = ray.remote(RewardModel)
            actors[part.part_name] = [
                actor.options(num_cpus=part.num_cpus, num_gpus=part.num_gpus,
                              **next(options, {}))
                .remote(part, max(1, int(part.num_cpus))) for _ in range(part.num_actors)]
        elif served_in_gang(part):  # a judge without a url
            engine = TorchEngineConfig(
                num_engines=part.num_actors, num_cpus=part.num_cpus, num_gpus=part.num_gpus,
                device="cuda" if part.num_gpus > 0 else "cpu",
                dtype=("bfloat16" if part.num_gpus > 0 else "float32") if part.dtype == "auto"
                else part.dtype, num_threads=max(1, int(part.num_cpus)), prefix_cache_mb=0)
            path = resolve(part.model)
            actor = ray.remote(JudgeEngine)
            actors[part.part_name] = [
                actor.options(num_cpus=part.num_cpus, num_gpus=part.num_gpus,
                              **next(options, {})).remote(engine, path, path, rank)
                for rank in range(part.num_actors)]
    return actors


class Rewarder:
    """Every part of ``rollout.reward``: rules scored here, models and judges asked of
    their actors (or server)."""

    def __init__(self, parts: list[Any], actors: dict[str, list[Any]]) -> None:
        self.parts = parts
        self.actors = actors
        self.rules = {p.part_name: RewardScorer(p) for p in parts
                      if isinstance(p, RewardConfig)}
        self.moments = {p.part_name: RunningMoments() for p in parts
                        if isinstance(p, RewardModelConfig) and p.normalize}
        self._server = ThreadPoolExecutor(max_workers=2) if any(
            isinstance(p, JudgeConfig) and p.url for p in parts) else None

    def submit(self, policy_prompts: list[str], raw_prompts: list[Any], responses: list[str],
               labels: list[str | None], metadata: list[dict[str, Any]]) -> _Pending:
        """Ask for one shard's scores: the actors' and a server's start now; the rules'
        are computed here meanwhile."""
        pending = _Pending(len(responses))
        for part in self.parts:
            name = part.part_name
            if isinstance(part, RewardModelConfig):
                prompts = raw_prompts if part.chat_template else policy_prompts
                pending.refs[name] = [
                    actor.score.remote(prompts[a:b], responses[a:b]) for actor, (a, b) in
                    zip(self.actors[name], _shards(len(responses), len(self.actors[name])),
                        strict=False)]
            elif isinstance(part, JudgeConfig):
                requests = [judge_request(part.template, p, r, lb) for p, r, lb in
                            zip(raw_prompts, responses, labels, strict=True)]
                if part.url is not None:
                    assert self._server is not None
                    pending.futures[name] = self._server.submit(
                        lambda c=part, q=requests: (ask_server(c, q), 0.0))
                else:
                    pending.refs[name] = [
                        actor.answer.remote(requests[a:b], part.max_new_tokens)
                        for actor, (a, b) in zip(self.actors[name], _shards(
                            len(requests), len(self.actors[name])), strict=False)]
        for name, scorer in self.rules.items():
            pending.rules[name] = scorer.score(responses, labels, metadata)
        return pending

    def collect(self, pendings: list[_Pending], update_stats: bool = True) -> RewardScores:
        """The shards' scores in shard order, combined; ``update_stats``: a training
        rollout (an evaluation leaves the running statistics as they are)."""
        parts: dict[str, list[float]] = {}
        scores = RewardScores([], parts)
        for part in self.parts:
            name, values = part.part_name, []
            for pending in pendings:
                if name in pending.rules:
                    result = pending.rules[name]
                    values += result.rewards
                    count, first = scores.errors.get(name, (0, None))
                    scores.errors[name] = (count + result.num_errors,
                                           first or result.first_error)
                    continue
                answers: list[Any] = []
                if name in pending.futures:
                    answered, seconds = pending.futures[name].result()
                    answers += answered
                    scores.busy_s += seconds
                for shard, seconds in ray.get(pending.refs.get(name, [])):
                    answers += shard
                    scores.busy_s += seconds
                values += answers
            if isinstance(part, JudgeConfig):
                parsed = [parse_score(a, part.parse) for a in values]
                scores.unparsed[name] = sum(s is None for s in parsed)
                values = [0.0 if s is None else s for s in parsed]
            elif name in self.moments:
                if update_stats:
                    self.moments[name].update(values)
                values = self.moments[name].normalize(values)
            parts[name] = [float(v) for v in values]
        size = sum(p.size for p in pendings)
        scores.total = [sum(p.weight * parts[p.part_name][i] for p in self.parts)
                        for i in range(size)]
        return scores

    def score(self, policy_prompts: list[str], raw_prompts: list[Any], responses: list[str],
              labels: list[str | None], metadata: list[dict[str, Any]],
              update_stats: bool = True) -> RewardScores:
        """:meth:`submit` then :meth:`collect`, for one batch."""
        return self.collect([self.submit(policy_prompts, raw_prompts, responses, labels,
                                         metadata)], update_stats)

    def state_dict(self) -> dict[str, Any]:
        return {name: [m.count, m.mean, m.m2] for name, m in self.moments.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, (count, mean, m2) in state.items():
            if name in self.moments:
                self.moments[name] = RunningMoments(int(count), float(mean), float(m2))
