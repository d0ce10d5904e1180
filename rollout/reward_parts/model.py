"""A learned reward model (``type: model``): actors in the job's gang serve
rollout/reward_model.py; a shard's samples are split between them. Each scores the
record's prompt and the response in the one tokenization train-rm shares
(rollout/reward_text.py), with the folder's tally_reward_model.json settings
(rollout/reward_model_info.py: unset ones taken, contradicting ones refused at preflight).
Texts over ``max_length`` are counted (``reward/<name>/truncated``); under
``truncation: refuse`` they are unscored (None, counted in ``reward/<name>/unscored``).
Batches an actor halved after running out of memory count in ``reward/<name>/oom_retries``.

A score may be normalised, r = (s − μ) / σ, with μ, σ the running mean and std of every
raw score so far (this rollout's included; Chan's merge of (n, mean, M2), saved in the
manager's state so a resume continues them). A normalised score is a
:class:`NormalizedScore`: the float r that the reward sums, carrying its raw s, so the
step logs ``reward/<name>/raw_mean`` beside the normalised mean (rollout/rollouts/step.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rollout.reward_config import RewardModelConfig
from rollout.reward_parts.base import PartScores, RewardPart, RewardShard
from rollout.shards import shard_bounds


class NormalizedScore(float):
    """A normalised score r (the float itself) that keeps the raw score s it came from."""

    raw: float

    def __new__(cls, value: float, raw: float) -> NormalizedScore:
        score = super().__new__(cls, value)
        score.raw = raw
        return score

    def __reduce__(self) -> tuple[Any, ...]:
        return NormalizedScore, (float(self), self.raw)  # across Ray: both kept


def raw_value(value: float) -> float:
    """The raw score behind ``value``: its ``raw`` when normalised, else itself."""
    return value.raw if isinstance(value, NormalizedScore) else value


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
        """(v − mean) / max(std, 1e-6) of each value, each keeping its raw value."""
        scale = max(self.std, 1e-6)
        return [NormalizedScore((v - self.mean) / scale, v) for v in values]


def actor_shards(num_items: int, num_actors: int) -> list[tuple[int, int]]:
    """Each actor's slice of a shard (rollout/shards.py), empty ones left out."""
    return [(a, b) for a, b in shard_bounds(num_items, num_actors) if b > a]


class ModelPart(RewardPart):
    """Reward actors (AutoModelForSequenceClassification, one label) in the gang."""

    config: RewardModelConfig
    count_names: ClassVar[tuple[str, ...]] = ("truncated", "unscored", "oom_retries")

    def __init__(self, config: RewardModelConfig) -> None:
        super().__init__(config)
        self.actors: list[Any] = []
        self.moments = RunningMoments() if config.normalize else None

    def actor_bundles(self) -> list[dict[str, float]]:
        bundle = {"CPU": self.config.num_cpus, "GPU": self.config.num_gpus}
        return [{k: v for k, v in bundle.items() if v}] * self.config.num_actors

    def check(self, field: str) -> None:
        from rollout.reward_checks import check_local_folder, check_reward_model
        from rollout.reward_model_info import served_config

        check_local_folder(self.config.path, f"{field}.path", "reward-model")
        if self.config.tokenizer is not None:
            check_local_folder(self.config.tokenizer, f"{field}.tokenizer", "tokenizer")
        # what training wrote: unset settings taken, contradicting ones refused
        check_reward_model(served_config(self.config, field), field)

    def start_actors(self, resolve: Callable[[str], str],
                     options: list[dict[str, Any]]) -> list[Any]:
        import ray

        from rollout.reward_model import RewardModel
        from rollout.reward_model_info import served_config

        # the folder's settings filled in; a worker's cwd may not be the caller's
        config = served_config(self.config).model_copy(update={
            "path": str(Path(self.config.path).expanduser().resolve()),
            "tokenizer": self.config.tokenizer
            and str(Path(self.config.tokenizer).expanduser().resolve())})
        actor = ray.remote(RewardModel)
        return [actor.options(num_cpus=config.num_cpus, num_gpus=config.num_gpus, **option)
                .remote(config, max(1, int(config.num_cpus))) for option in options]

    def bind(self, actors: list[Any]) -> None:
        self.actors = actors

    def submit(self, shard: RewardShard) -> list[Any]:
        # the record's prompt, as train-rm's pairs hold it: never the policy's templated
        # text (its special tokens would be added a second time)
        prompts = shard.raw_prompts
        bounds = actor_shards(len(shard), len(self.actors))
        return [actor.score_shard.remote(prompts[a:b], shard.responses[a:b])
                for actor, (a, b) in zip(self.actors, bounds, strict=False)]

    def collect(self, handles: list[list[Any]], update_stats: bool = True) -> PartScores:
        import ray

        values: list[float | None] = []
        busy_s, truncated, retries = 0.0, 0, 0
        for scores, busy, over, halved in ray.get([ref for refs in handles
                                                   for ref in refs]):
            values += [None if v is None else float(v) for v in scores]
            busy_s += busy
            truncated += over
            retries += halved
        if self.moments is not None:
            scored = [v for v in values if v is not None]
            if update_stats:
                self.moments.update(scored)
            normal = iter(self.moments.normalize(scored))
            values = [None if v is None else next(normal) for v in values]
        unscored = sum(v is None for v in values)  # refused: over max_length
        return PartScores(values, busy_s,
                          counts={"truncated": truncated, "unscored": unscored,
                                  "oom_retries": retries})

    def metric_names(self) -> list[str]:
        raw = [f"reward/{self.name}/raw_mean"] if self.config.normalize else []
        return [*super().metric_names(), *raw]

    def state_dict(self) -> Any:
        m = self.moments
        return None if m is None else [m.count, m.mean, m.m2]

    def load_state_dict(self, state: Any) -> None:
        if self.moments is not None:
            count, mean, m2 = state
            self.moments = RunningMoments(int(count), float(mean), float(m2))
