"""The plan of one optimizer step, made once before the step is split across ranks.

It fixes the aggregation weights of every loss term from whole-step metadata (so the
layout cannot change J) and assigns samples to DP ranks and token-budget micro-batches.
FSDP's collectives need every rank to run the same number of forwards, so ranks that
get fewer micro-batches run empty ones (weight 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.batch import TrainBatch
from trainer.aggregation import AGGREGATION_MODES, token_weights, weights_for_config
from trainer.config import AggregationConfig, LossConfig

MODE_METRIC_PREFIX = "pg_loss/"


@dataclass(frozen=True)
class StepPlan:
    weights: dict[str, torch.Tensor]
    """Per-token weights [N, S] aligned with input_ids: "pg", "kl", "entropy" and one per
    aggregation mode (``pg_loss/<mode>``) for the dashboard's per-mode metric."""
    micro_batches: list[list[list[int]]]
    """[dp_rank][micro_batch] -> sample indices; every rank has the same count."""
    padding_fraction: float
    """Share of the padded micro-batch tokens that are padding."""


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
    loss: LossConfig,
    dp_size: int,
    cp_size: int,
    max_tokens_per_micro_batch: int,
    max_response_len: int | None = None,
) -> StepPlan:
    """Weights for every term and the micro-batch assignment of one step."""

    def weights_of(config: AggregationConfig | None, use_custom_reducer: bool) -> torch.Tensor:
        return weights_for_config(
            config or loss.aggregation,
            batch.loss_mask,
            batch.group_index,
            max_response_len=max_response_len,
            group_size=batch.samples_per_prompt,
            use_custom_reducer=use_custom_reducer,
        )

    weights = {
        "pg": weights_of(loss.aggregation, use_custom_reducer=True),
        "kl": weights_of(loss.kl_aggregation, use_custom_reducer=False),
        "entropy": weights_of(loss.entropy_aggregation, use_custom_reducer=False),
    }
    configured = loss.aggregation.resolved_divisor(max_response_len)
    divisor = configured or float(max_response_len or batch.input_ids.shape[1])
    for mode in AGGREGATION_MODES:
        weights[MODE_METRIC_PREFIX + mode] = token_weights(
            batch.loss_mask, batch.group_index, mode, divisor if mode == "constant" else None,
            group_size=batch.samples_per_prompt,
        )
    lengths = batch.sequence_lengths.tolist()
    micro_batches = assign_micro_batches(lengths, dp_size, max_tokens_per_micro_batch)
    return StepPlan(weights, micro_batches, padding_fraction(lengths, micro_batches, cp_size))
