"""A rollout step's played samples, grouped, as one RolloutBatch and its sample records.

    [Sample] × G per record ─► Group ─► RolloutBatch (rewards, masks, metrics) + SampleRecords

Group indices are contiguous from the manager's next one; the batch's advantages are
zeros here (the manager's estimator fills them). A sample a reward part left unscored (its
value None: rollout/reward_parts/rewarder.py) is missing, not zero: the batch marks it
(``scored`` False, reward the fill value 0.0), the reward metrics are over the scored
samples only, ``rollout/unscored_samples`` counts it and its record's reward is null.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from rollout.batch import RolloutBatch
from rollout.rollouts.base import Sample
from rollout.sample_record import SampleRecord
from rollout.sample_tokens import response_tokens


@dataclass(frozen=True)
class Group:
    """One record's G scored samples."""

    samples: list[Sample]


def groups_of(samples: list[Sample], group_size: int) -> list[Group]:
    """Consecutive runs of ``group_size`` samples (a play's requests, each record G times)."""
    return [Group(samples[j:j + group_size]) for j in range(0, len(samples), group_size)]


def build_batch(groups: list[Group], first_group: int, group_size: int, pad_token_id: int,
                metadata: dict[str, float], events: list[tuple[str, str]],
                records: list[SampleRecord]) -> RolloutBatch:
    """The step's RolloutBatch with the batch's reward and length metrics after
    ``metadata``; zero advantages."""
    samples = [s for g in groups for s in g.samples]
    group_index = [first_group + j for j, g in enumerate(groups) for _ in g.samples]
    generations = [s.generation for s in samples]
    scored = [s.scored for s in samples]
    rewards = torch.tensor([s.reward if ok else 0.0 for s, ok in zip(samples, scored,
                                                                      strict=True)],
                           dtype=torch.float32)
    kept = rewards[torch.tensor(scored, dtype=torch.bool)]
    lengths = [len(gen.token_ids) for gen in generations]
    metadata = {
        **metadata,
        "rollout/reward_mean": float(kept.mean()) if len(kept) else 0.0,
        "rollout/reward_std": float(kept.std()) if len(kept) > 1 else 0.0,
        "rollout/unscored_samples": float(len(samples) - len(kept)),
        "rollout/response_length_mean": _mean(lengths),
        "rollout/response_length_max": float(max(lengths)),
        "rollout/truncated_fraction": _mean([bool(s.truncated) for s in samples]),
        **_part_metrics(samples),
    }
    holes = all(s.mask is not None for s in samples)  # episodes; else every token counts
    return RolloutBatch.from_samples(
        prompt_ids=[s.prompt_ids for s in samples],
        response_ids=[gen.token_ids for gen in generations],
        response_log_probs=[gen.log_probs for gen in generations],
        rewards=rewards.tolist(),
        advantages=[0.0] * len(generations),  # the estimator's, added by the manager
        group_index=group_index,
        samples_per_prompt=group_size,
        pad_token_id=pad_token_id,
        response_masks=[s.mask for s in samples] if holes else None,
        metadata=metadata,
        events=events,
        turn_rewards=[s.turn_rewards for s in samples] if holes else None,
        samples=records,
        truncated=[bool(s.truncated) for s in samples],
        scored=scored,
        response_versions=([gen.versions for gen in generations]  # type: ignore[misc]
                           if all(gen.versions is not None for gen in generations) else None),
    )


def training_records(groups: list[Group], first_group: int, step: int, limit: int,
                     tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> list[SampleRecord]:
    """SampleRecords of ``limit`` of the step's samples (the driver adds each one's
    advantage): whole groups in a random order, the last one drawn cut to make exactly
    ``limit`` (every sample when the step has fewer). The order is drawn from (``seed``,
    ``step``) alone, so a resumed run logs the same samples. Each record's ``index`` is
    its row in the step's RolloutBatch (``build_batch`` lays the groups out in order),
    and the records come in row order; each carries its response token by token as
    rollout knows it (rollout/sample_tokens.py; the driver adds the trainer's numbers)."""
    starts = [0]
    for group in groups:
        starts.append(starts[-1] + len(group.samples))
    order = list(range(len(groups)))
    random.Random(f"samples:{seed}:{step}").shuffle(order)  # str seeds: process-stable
    chosen: list[tuple[int, int]] = []  # (group, member)
    for j in order:
        take = min(len(groups[j].samples), limit - len(chosen))
        if take <= 0:
            break
        chosen.extend((j, k) for k in range(take))
    records = []
    for j, k in sorted(chosen):
        sample = groups[j].samples[k]
        records.append(SampleRecord(
            step=step, index=starts[j] + k, group=first_group + j,
            prompt=tokenizer.decode(sample.prompt_ids, skip_special_tokens=False),
            record_prompt=sample.record.prompt, response=sample.text,
            label=sample.record.label,
            reward=float(sample.reward) if sample.scored else None,
            rewards=dict(sample.parts), response_tokens=len(sample.generation.token_ids),
            judge_answers=dict(sample.answers), tokens=response_tokens(sample, tokenizer)))
    return records


def _mean(values: list[float] | list[int] | list[bool]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _part_metrics(samples: list[Sample]) -> dict[str, float]:
    """``reward/<name>/mean`` and ``/std`` of each reward part over the batch's samples it
    scored (its None left out; 0 when it scored none); for a part whose values are
    normalised (``normalize: true``), ``reward/<name>/raw_mean`` too: the mean of the raw
    scores they were normalised from (rollout/reward_parts/model.py)."""
    from rollout.reward_parts.model import NormalizedScore, raw_value

    out: dict[str, float] = {}
    for name in samples[0].parts if samples else []:
        scored = [v for s in samples if (v := s.parts[name]) is not None]
        values = torch.tensor(scored, dtype=torch.float64)
        out[f"reward/{name}/mean"] = float(values.mean()) if len(values) else 0.0
        out[f"reward/{name}/std"] = float(values.std()) if len(values) > 1 else 0.0
        if any(isinstance(v, NormalizedScore) for v in scored):
            out[f"reward/{name}/raw_mean"] = float(torch.tensor(
                [raw_value(v) for v in scored], dtype=torch.float64).mean())
    return out
