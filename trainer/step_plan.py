"""The plan of one optimizer step, made once before the step is split across ranks.

It fixes the aggregation coefficients of every loss term from whole-step metadata (so the
layout cannot change J) and assigns samples to DP ranks and token-budget micro-batches.
Built-in modes ship one coefficient per sample (w_it = m_it · c_i, built on each rank);
only a custom reducer ships dense [N, S] weights.
FSDP's collectives need every rank to run the same number of forwards, so ranks that
get fewer micro-batches run empty ones (weight 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.batch import TrainBatch
from trainer.aggregation import AGGREGATION_MODES, custom_reducer_weights, sample_coefficients
from trainer.config import ObjectiveConfig, TermAggregationConfig

MODE_METRIC_PREFIX = "pg_loss/"


@dataclass(frozen=True)
class StepPlan:
    coefficients: dict[str, torch.Tensor]
    """Per-sample c_i [N] float64: "pg", "kl", "entropy" and one per aggregation mode
    (``pg_loss/<mode>``) for the dashboard's per-mode metric."""
    micro_batches: list[list[list[int]]]
    """[dp_rank][micro_batch] -> sample indices; every rank has the same count."""
    padding_fraction: float
    """Share of the padded micro-batch tokens that are padding."""
    dense_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token weights [N, S] aligned with input_ids, only for a custom pg reducer."""

    @property
    def terms(self) -> list[str]:
        """Every weighted term, in a fixed order (the order of the logged sums)."""
        return [*self.coefficients, *(t for t in self.dense_weights
                                      if t not in self.coefficients)]

    @property
    def mode_metric_names(self) -> list[str]:
        return [t for t in self.terms if t.startswith(MODE_METRIC_PREFIX)]


def assign_micro_batches(
    lengths: list[int], dp_size: int, max_tokens: int
) -> list[list[list[int]]]:
    """Balance samples over DP ranks by tokens, then pack each rank's samples, sorted by
    length, into micro-batches of at most ``max_tokens`` padded tokens.

    A sample longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rank_samples: list[list[int]] = [[] for _ in range(dp_size)]
    rank_tokens = [0] * dp_size
    for i in order:  # longest first onto the least loaded rank
        rank = min(range(dp_size), key=lambda r: (rank_tokens[r], len(rank_samples[r]), r))
        rank_samples[rank].append(i)
        rank_tokens[rank] += lengths[i]
    plans: list[list[list[int]]] = []
    for samples in rank_samples:
        micro_batches: list[list[int]] = []
        for i in samples:  # already longest first: the first sample sets the padded width
            current = micro_batches[-1] if micro_batches else None
            if current and (len(current) + 1) * lengths[current[0]] <= max_tokens:
                current.append(i)
            else:
                micro_batches.append([i])
        plans.append(micro_batches)
    num_micro_batches = max(1, *(len(p) for p in plans))
    for plan in plans:
        plan.extend([] for _ in range(num_micro_batches - len(plan)))
    return plans


def padding_fraction(
    lengths: list[int], micro_batches: list[list[list[int]]], cp_size: int
) -> float:
    """1 − real tokens / padded tokens over every micro-batch of every rank."""
    chunk_multiple = 2 * cp_size if cp_size > 1 else 1
    real = padded = 0
    for plan in micro_batches:
        for samples in plan:
            if samples:
                width = max(lengths[i] for i in samples)
                width = -(-width // chunk_multiple) * chunk_multiple
                real += sum(lengths[i] for i in samples)
                padded += width * len(samples)
    return 1.0 - real / padded if padded else 0.0


def plan_step(
    batch: TrainBatch,
    objective: ObjectiveConfig,
    dp_size: int,
    cp_size: int,
    max_tokens_per_micro_batch: int,
) -> StepPlan:
    """Coefficients for every term and the micro-batch assignment of one step."""

    counts = batch.loss_mask.to(torch.float64).sum(dim=-1)  # M_i

    def coefficients_of(term: TermAggregationConfig) -> torch.Tensor:
        return sample_coefficients(counts, batch.group_index, term.mode,
                                   term.numeric_divisor, group_size=batch.samples_per_prompt)

    coefficients: dict[str, torch.Tensor] = {}
    dense_weights: dict[str, torch.Tensor] = {}
    if objective.pg.custom_reducer is not None:
        dense_weights["pg"] = custom_reducer_weights(objective.pg.custom_reducer,
                                                     batch.loss_mask, batch.group_index)
    else:
        coefficients["pg"] = coefficients_of(objective.pg)
    coefficients["kl"] = coefficients_of(objective.kl)
    coefficients["entropy"] = coefficients_of(objective.entropy)
    divisor = objective.pg.numeric_divisor or objective.metric_divisor
    for mode in AGGREGATION_MODES:
        coefficients[MODE_METRIC_PREFIX + mode] = coefficients_of(TermAggregationConfig(
            mode=mode, divisor=divisor if mode == "constant" else None))
    lengths = batch.sequence_lengths.tolist()
    micro_batches = assign_micro_batches(lengths, dp_size, max_tokens_per_micro_batch)
    return StepPlan(coefficients, micro_batches,
                    padding_fraction(lengths, micro_batches, cp_size), dense_weights)
