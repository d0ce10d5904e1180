"""The plan of one optimizer step, made once before the step is split across ranks.

It fixes the aggregation coefficients of every loss term from whole-step metadata (so the
layout cannot change J) and assigns samples to DP ranks and token-budget micro-batches.
Packed (the default): each micro-batch is one row holding several whole samples back to
back, filled first-fit decreasing up to the budget of real tokens (each sample rounded up
to a multiple of 2·cp, as THD context parallelism needs); the row's ``cu_seqlens`` are the
sample boundaries. Padded: each micro-batch is [b, longest] and the budget counts padding.
Built-in modes ship one coefficient per sample (w_it = m_it · c_i, built on each rank);
only a custom reducer ships dense [N, S] weights.
FSDP's collectives need every rank to run the same number of forwards, so ranks that
get fewer micro-batches run empty ones (weight 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.batch import RolloutBatch
from trainer.aggregation import AGGREGATION_MODES, custom_reducer_weights, sample_coefficients
from trainer.config import ObjectiveConfig, TermAggregationConfig, TrainerConfig
from trainer.context_parallel import padded_length
from trainer.terms import PLANNED_TERMS

MODE_METRIC_PREFIX = "pg_loss/"


@dataclass(frozen=True)
class StepPlan:
    coefficients: dict[str, torch.Tensor]
    """Per-sample c_i [N] float64: one per planned term (trainer/terms.py: "pg", "kl",
    "entropy", "value") and one per aggregation mode (``pg_loss/<mode>``) for the
    dashboard's per-mode metric."""
    micro_batches: list[list[list[int]]]
    """[dp_rank][micro_batch] -> sample indices; every rank has the same count."""
    padding_fraction: float
    """Share of the computed micro-batch tokens that are padding."""
    packed: bool = True
    """Micro-batches are packed rows (one [1, Σ L_i] sequence each), else padded."""
    cu_seqlens: list[list[list[int]]] = field(default_factory=list)
    """[dp_rank][micro_batch] -> cumulative (CP-rounded) sample lengths of a packed row,
    starting at 0; empty when padded."""
    dense_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token weights [N, S] aligned with input_ids, only for a custom pg reducer."""
    prefix_skip: torch.Tensor | None = None
    """Shared prefix: [N] leading tokens each sample leaves to its head (0 for a head and
    for a sample that shares nothing); None: nothing is shared."""
    prefix_head: torch.Tensor | None = None
    """Shared prefix: [N] the sample whose prompt tokens each sample attends to (itself
    when it shares nothing); a head comes first in its row, its chunk right after it."""
    computed_tokens: int = 0
    """Tokens the forward computes over every rank's rows (padding and CP rounding
    included; shared prompt tokens once)."""

    @property
    def terms(self) -> list[str]:
        """Every weighted term, in a fixed order (the order of the logged sums)."""
        return [*self.coefficients, *(t for t in self.dense_weights
                                      if t not in self.coefficients)]

    @property
    def mode_metric_names(self) -> list[str]:
        return [t for t in self.terms if t.startswith(MODE_METRIC_PREFIX)]


def balance_ranks(lengths: list[int], dp_size: int) -> list[list[int]]:
    """Samples onto DP ranks, longest first onto the least loaded rank (by tokens); each
    rank's list stays longest first."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rank_samples: list[list[int]] = [[] for _ in range(dp_size)]
    rank_tokens = [0] * dp_size
    for i in order:
        rank = min(range(dp_size), key=lambda r: (rank_tokens[r], len(rank_samples[r]), r))
        rank_samples[rank].append(i)
        rank_tokens[rank] += lengths[i]
    return rank_samples


def pad_micro_batches(samples: list[int], lengths: list[int], max_tokens: int
                      ) -> list[list[int]]:
    """Padded micro-batches of longest-first ``samples``: at most ``max_tokens`` padded
    tokens each (the first sample sets the width); a longer sample gets one alone."""
    micro_batches: list[list[int]] = []
    for i in samples:
        current = micro_batches[-1] if micro_batches else None
        if current and (len(current) + 1) * lengths[current[0]] <= max_tokens:
            current.append(i)
        else:
            micro_batches.append([i])
    return micro_batches


def pack_rows(samples: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: each sample (longest first) into the first row with room for
    it, at most ``max_tokens`` tokens a row; a sample longer than that gets a row alone."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(samples, key=lambda i: (-lengths[i], i)):
        fit = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
        if fit is None:
            rows.append([i])
            room.append(max_tokens - lengths[i])
        else:
            rows[fit].append(i)
            room[fit] -= lengths[i]
    return rows


def assign_micro_batches(lengths: list[int], dp_size: int, max_tokens: int,
                         packed: bool = True) -> list[list[list[int]]]:
    """[dp_rank][micro_batch] -> samples: balanced over ranks by tokens, then packed into
    rows (or padded micro-batches); every rank gets the same count (empty ones added)."""
    split = pack_rows if packed else pad_micro_batches
    plans = [split(samples, lengths, max_tokens) for samples in balance_ranks(lengths, dp_size)]
    num_micro_batches = max(1, *(len(p) for p in plans))
    for plan in plans:
        plan.extend([] for _ in range(num_micro_batches - len(plan)))
    return plans


def token_counts(lengths: list[int], micro_batches: list[list[list[int]]], cp_size: int,
                 packed: bool = True) -> tuple[int, int]:
    """(real, computed) tokens over every non-empty micro-batch of every rank. Packed
    rows compute each sample's ``lengths`` rounded up to 2·cp; padded micro-batches
    compute b × (longest, rounded up to 2·cp)."""
    real = computed = 0
    for plan in micro_batches:
        for samples in plan:
            if samples:
                real += sum(lengths[i] for i in samples)
                computed += (sum(padded_length(lengths[i], cp_size) for i in samples) if packed
                             else padded_length(max(lengths[i] for i in samples), cp_size)
                             * len(samples))
    return real, computed


def padding_fraction(lengths: list[int], micro_batches: list[list[list[int]]], cp_size: int,
                     packed: bool = True) -> float:
    """1 − real tokens / computed tokens (:func:`token_counts`)."""
    real, computed = token_counts(lengths, micro_batches, cp_size, packed)
    return 1.0 - real / computed if computed else 0.0


def row_cu_seqlens(samples: list[int], lengths: list[int], cp_size: int) -> list[int]:
    """[0, L_0, L_0 + L_1, ...] of a packed row, each L rounded up to 2·cp."""
    bounds = [0]
    for i in samples:
        bounds.append(bounds[-1] + padded_length(lengths[i], cp_size))
    return bounds


def prefix_items(batch: RolloutBatch, max_tokens: int
                 ) -> tuple[list[list[int]], list[int], torch.Tensor]:
    """(items, their token costs, prefix_skip [N]): each group with identical prompt
    tokens (P ≥ 2) as chunks of at most ``max_tokens`` (a chunk's first sample whole, the
    others from position P − 1 on), every other sample an item alone.

    One pass: which samples repeat their group's first prompt is one [N, S] comparison,
    the groups' members one walk over ``group_index`` (a 256-sample step: ≈ 1 ms, not
    one tensor scan per group)."""
    lengths = batch.sequence_lengths.tolist()
    members_of: dict[int, list[int]] = {}
    for j, group in enumerate(batch.group_index.tolist()):
        members_of.setdefault(group, []).append(j)
    first_of = [0] * batch.num_samples
    for members in members_of.values():
        for j in members:
            first_of[j] = members[0]
    # index_select, not x[first]: advanced indexing wakes the intra-op thread pool even
    # for a few KB, which costs a scheduler slice per call (≈ 7 ms here on a busy CPU)
    first = torch.tensor(first_of, dtype=torch.int64)
    prompt = batch.prompt_lengths.index_select(0, first)  # [N] its group's first prompt
    in_prompt = torch.arange(batch.input_ids.shape[1]) < prompt[:, None]
    same_tokens = batch.input_ids == batch.input_ids.index_select(0, first)
    repeats = ((batch.prompt_lengths == prompt) & (same_tokens | ~in_prompt).all(dim=1)
               ).tolist()
    prompt_lengths = prompt.tolist()
    skip = [0] * batch.num_samples
    items: list[list[int]] = []
    costs: list[int] = []
    for group in sorted(members_of):  # ascending, as batch.group_ids
        members = members_of[group]
        shared = prompt_lengths[members[0]] - 1
        if shared < 1 or len(members) == 1 or not all(repeats[j] for j in members):
            items += [[j] for j in members]
            costs += [lengths[j] for j in members]
            continue
        opened = False  # the group's first chunk is not open yet
        for j in sorted(members, key=lambda j: (-lengths[j], j)):
            if opened and costs[-1] + lengths[j] - shared <= max_tokens:
                items[-1].append(j)
                costs[-1] += lengths[j] - shared
                skip[j] = shared
            else:
                items.append([j])
                costs.append(lengths[j])
                opened = True
    return items, costs, torch.tensor(skip, dtype=torch.int64)


def plan_prefix_rows(batch: RolloutBatch, dp_size: int, max_tokens: int
                     ) -> tuple[list[list[list[int]]], torch.Tensor, torch.Tensor]:
    """([dp_rank][row] -> samples, prefix_skip, prefix_head): the items of
    :func:`prefix_items` balanced over ranks by tokens, then first-fit decreasing into
    rows; every rank gets the same number of rows."""
    items, costs, skip = prefix_items(batch, max_tokens)
    head = torch.arange(batch.num_samples)
    for item in items:
        head[item] = item[0]
    plans = [[[j for k in row for j in items[k]] for row in pack_rows(rank, costs, max_tokens)]
             for rank in balance_ranks(costs, dp_size)]
    num_rows = max(1, *(len(p) for p in plans))
    for plan in plans:
        plan.extend([] for _ in range(num_rows - len(plan)))
    return plans, skip, head


def packs(config: TrainerConfig) -> bool:
    """Whether the trainer computes packed rows: FSDP with ``packing`` on, or Megatron
    where its attention decision allows THD rows (``backends.megatron.decide_attention``:
    GPU, TransformerEngine, bf16); elsewhere Megatron pads the same plan."""
    if not config.packing:
        return False
    if config.backend == "fsdp":
        return True
    from trainer.backends.megatron import decide_attention

    return decide_attention(config).packed


def plan_step(
    batch: RolloutBatch,
    objective: ObjectiveConfig,
    dp_size: int,
    cp_size: int,
    max_tokens_per_micro_batch: int,
    packed: bool = True,
    shared_prefix: bool = False,
) -> StepPlan:
    """Coefficients for every term and the micro-batch assignment of one step
    (``shared_prefix``: packed rows share each group's identical prompt; CP 1 only)."""

    counts = batch.loss_mask.to(torch.float64).sum(dim=-1)  # M_i

    def coefficients_of(term: TermAggregationConfig) -> torch.Tensor:
        return sample_coefficients(counts, batch.group_index, term.mode,
                                   term.numeric_divisor, group_size=batch.samples_per_prompt)

    coefficients: dict[str, torch.Tensor] = {}
    dense_weights: dict[str, torch.Tensor] = {}
    reduced: torch.Tensor | None = None  # a custom reducer's weights, computed once
    for term in PLANNED_TERMS:  # each term under its own aggregation (ObjectiveConfig)
        aggregation = getattr(objective, str(term.aggregation))
        if term.aggregation == "pg" and objective.pg.custom_reducer is not None:
            # pg's, and the critic's value term (planned under the pg field: its reducer
            # is critic.custom_reducer there, trainer/config.py CriticConfig)
            if reduced is None:
                reduced = custom_reducer_weights(objective.pg.custom_reducer,
                                                 batch.loss_mask, batch.group_index)
            dense_weights[term.name] = reduced
        else:
            coefficients[term.name] = coefficients_of(aggregation)
    divisor = objective.mode_metric_divisor
    for mode in AGGREGATION_MODES:
        coefficients[MODE_METRIC_PREFIX + mode] = coefficients_of(TermAggregationConfig(
            mode=mode, divisor=divisor if mode == "constant" else None))
    lengths = batch.sequence_lengths.tolist()
    skip = head = None
    if shared_prefix and packed:
        if cp_size != 1:
            raise ValueError(f"shared_prefix: needs cp_size 1 (trainer.cp_size={cp_size})")
        micro_batches, skip, head = plan_prefix_rows(batch, dp_size, max_tokens_per_micro_batch)
        if not skip.any():
            skip = head = None  # no group shares its prompt: the plain packed layout
    else:
        budget_lengths = [padded_length(n, cp_size) for n in lengths] if packed else lengths
        micro_batches = assign_micro_batches(budget_lengths, dp_size,
                                             max_tokens_per_micro_batch, packed)
    # a sample's tokens in its row: all but those it leaves to its head
    row_lengths = lengths if skip is None else (batch.sequence_lengths - skip).tolist()
    cu_seqlens = [[row_cu_seqlens(row, row_lengths, cp_size) for row in rank]
                  for rank in micro_batches] if packed else []
    real, computed = token_counts(row_lengths, micro_batches, cp_size, packed)
    padding = 1.0 - real / computed if computed else 0.0
    return StepPlan(coefficients, micro_batches, padding, dense_weights=dense_weights,
                    packed=packed, cu_seqlens=cu_seqlens, prefix_skip=skip, prefix_head=head,
                    computed_tokens=computed)
