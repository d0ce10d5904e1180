"""The reward of a sample from its parts, each asked through rollout/reward_parts/base.py.

    r = Σ_k weight_k · r_k        (one part: r = weight · r_1)

A part's None (a sample it could not score: a judge's unparsed answer or failed call, a
custom part's None) makes the sample **unscored**: missing, never a zero reward. The
part's values keep the None (samples.jsonl writes null), ``scored`` is False, and the
sample's ``total`` is a placeholder (the parts that did score, summed) that nothing
trains on: the step's batch carries ``scored`` (rollout/batch.py), its advantage is 0
and it stays out of its group's baseline and statistics (rollout/advantages/). The part
counts it (``reward/<name>/unscored``).

The manager asks for a shard's scores as soon as its responses are generated
(:meth:`Rewarder.submit`: actors work while other engines still generate) and combines
them once all shards are in (:meth:`Rewarder.collect`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout.reward_parts.base import RewardPart, RewardShard
from rollout.reward_parts.registry import build_parts


@dataclass
class RewardScores:
    """A batch's rewards: the weighted total, each part's values, what went wrong."""

    total: list[float]
    """Σ weight · value over the parts that scored the sample (an unscored one's is a
    placeholder: see ``scored``)."""
    parts: dict[str, list[float | None]]
    """Part -> each sample's value, None where it left the sample unscored."""
    scored: list[bool] = field(default_factory=list)
    """Per sample: every part scored it (False: unscored, module docstring)."""
    answers: dict[str, list[str | None]] = field(default_factory=dict)
    """Part -> each sample's raw text (a judge's answer), for the parts that have one."""
    errors: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    """Part -> (samples whose scoring raised and fell back on its default, the first
    error)."""
    counts: dict[str, int] = field(default_factory=dict)
    """``reward/<name>/<key>`` -> count (a judge's unparsed answers)."""
    busy_s: float = 0.0
    """Seconds the reward actors spent on this batch."""


class Rewarder:
    """Every part of ``rollout.reward``, bound to its actors (by part name)."""

    def __init__(self, configs: list[Any], actors: dict[str, list[Any]]) -> None:
        self.parts: list[RewardPart] = build_parts(configs)
        for part in self.parts:
            part.bind(actors.get(part.name, []))

    def submit(self, policy_prompts: list[str], raw_prompts: list[Any], responses: list[str],
               labels: list[str | None], metadata: list[dict[str, Any]]) -> list[Any]:
        """Ask every part for one shard's scores: actors start now, the parts scored in
        this process score meanwhile. One handle per part."""
        shard = RewardShard(policy_prompts, raw_prompts, responses, labels, metadata)
        return [part.submit(shard) for part in self.parts]

    def collect(self, pendings: list[list[Any]], update_stats: bool = True) -> RewardScores:
        """The shards' scores in shard order, combined; ``update_stats``: a training
        rollout (an evaluation leaves running statistics as they are)."""
        scores = RewardScores([], {})
        size = None
        for k, part in enumerate(self.parts):
            result = part.collect([handles[k] for handles in pendings], update_stats)
            scores.parts[part.name] = list(result.values)
            if result.answers is not None:
                scores.answers[part.name] = list(result.answers)
            scores.errors[part.name] = (result.num_errors, result.first_error)
            scores.counts.update({f"reward/{part.name}/{key}": count
                                  for key, count in result.counts.items()})
            scores.busy_s += result.busy_s
            size = len(result.values)
        values = [[scores.parts[p.name][i] for p in self.parts] for i in range(size or 0)]
        scores.scored = [all(v is not None for v in row) for row in values]
        scores.total = [sum(p.weight * v for p, v in zip(self.parts, row, strict=True)
                            if v is not None) for row in values]
        return scores

    def score(self, policy_prompts: list[str], raw_prompts: list[Any], responses: list[str],
              labels: list[str | None], metadata: list[dict[str, Any]],
              update_stats: bool = True) -> RewardScores:
        """:meth:`submit` then :meth:`collect`, for one batch."""
        return self.collect([self.submit(policy_prompts, raw_prompts, responses, labels,
                                         metadata)], update_stats)

    def check_errors(self, errors: dict[str, tuple[int, str | None]], num_samples: int,
                     step: int) -> None:
        """Each part's errors of a rollout against what it allows (RewardError)."""
        for part in self.parts:
            count, first = errors.get(part.name, (0, None))
            part.check_errors(count, first, num_samples, step)

    def state_dict(self) -> dict[str, Any]:
        return {part.name: state for part in self.parts
                if (state := part.state_dict()) is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            if part.name in state and part.state_dict() is not None:
                part.load_state_dict(state[part.name])
