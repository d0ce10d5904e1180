"""Evaluation: held-out records played greedily and sampled through the rollout
interface, the same for a prompt and an environment's episodes.

    requests ─► Rollout.play([greedy play, sampled play (each request k times)]) ─► EvalRun

Seeds derive from (seed, "eval:<step>:greedy" | "eval:<step>:sampled") and the play
is an evaluation (no reward statistics move), so training's stream and a resume stay
exact. An outcome's greedy length is its response's (an episode's observations
included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from rollout.config import SamplingConfig
from rollout.rollouts.base import Play, Request, Rollout, Sample
from rollout.sample_record import SampleRecord


@dataclass(frozen=True)
class EvalOutcome:
    """One held-out prompt's evaluation: the greedy response's reward and length, and the
    rewards of its sampled responses (for pass@k)."""

    metadata: dict[str, Any]
    greedy_reward: float
    greedy_length: int
    sample_rewards: list[float]
    samples: list[SampleRecord] = field(default_factory=list)
    """samples.jsonl records of its responses, the greedy one first."""


@dataclass(frozen=True)
class EvalRun:
    """One evaluation: the weight version the engines held and each prompt's outcome."""

    weight_version: int
    outcomes: list[EvalOutcome]


def evaluate(rollout: Rollout, requests: list[Request], num_samples: int,
             greedy: SamplingConfig, sampled: SamplingConfig, step: int, weight_version: int,
             tokenizer: PreTrainedTokenizerBase) -> EvalRun:
    """Each request's greedy response and ``num_samples`` sampled ones, scored."""
    plays = [Play(requests, greedy, f"eval:{step}:greedy")]
    if num_samples:
        plays.append(Play([r for r in requests for _ in range(num_samples)], sampled,
                          f"eval:{step}:sampled"))
    samples = rollout.play(plays, training=False).samples
    n = len(requests)
    records = [_record(s, step, i < n, j, tokenizer) for i, (s, j) in enumerate(zip(
        samples, [*range(n), *(j for j in range(n) for _ in range(num_samples))],
        strict=True))]
    outcomes = []
    for j, request in enumerate(requests):
        rows = slice(n + j * num_samples, n + (j + 1) * num_samples)
        outcomes.append(EvalOutcome(
            request.record.metadata, samples[j].reward, len(samples[j].generation.token_ids),
            [s.reward for s in samples[rows]], [records[j], *records[rows]]))
    return EvalRun(weight_version, outcomes)


def _record(sample: Sample, step: int, greedy: bool, group: int,
            tokenizer: PreTrainedTokenizerBase) -> SampleRecord:
    return SampleRecord(
        step=step, greedy=greedy, group=group,
        prompt=tokenizer.decode(sample.prompt_ids, skip_special_tokens=False),
        record_prompt=sample.record.prompt, response=sample.text, label=sample.record.label,
        reward=float(sample.reward) if sample.scored else None,
        rewards=dict(sample.parts), response_tokens=len(sample.generation.token_ids),
        judge_answers=dict(sample.answers))
