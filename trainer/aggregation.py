r"""Loss aggregation: the one place where per-token losses become the step objective J.

For one optimizer step: N samples from P prompt groups (G samples each). Sample i has
per-token loss ℓ_it, loss weight m_it ∈ [0, 1] (0 or 1 for a plain mask; a fraction weights a
token partly) and M_i = Σ_t m_it its weight in tokens; group g has
T_g = Σ_{i∈g} M_i (``prompt_mask_sums``); L is the constant divisor.

    sample_mean  J = (1/N) Σ_i (1/M_i) Σ_t m_it ℓ_it          w_it = m_it / (N · M_i)
    token_mean   J = Σ_i Σ_t m_it ℓ_it / Σ_i M_i              w_it = m_it / Σ_j M_j
    prompt_mean  J = (1/P) Σ_g (1/T_g) Σ_{i∈g} Σ_t m_it ℓ_it  w_it = m_it / (P · T_g(i))
    constant     J = Σ_i Σ_t m_it ℓ_it / (L · N)              w_it = m_it / (L · N)

A sample (group) with no valid token has weight 0 and still counts in N (P); no phantom
token is ever added. Every mode is J = Σ w_it ℓ_it with weights fixed from whole-step
metadata *before* the step is split, so each rank sums w·ℓ over the tokens it owns (its
micro-batches, its CP shard) and the gradients are SUMMED over DP×CP ranks and
micro-batches: the layout cannot change J nor ∇J. A framework that averages instead of
summing undoes that with :func:`sum_reduction_factor`, and nowhere else.

A custom reducer (``AggregationConfig.custom_reducer = "module:function"``) replaces the
built-in mode for the pg term. Its signature is::

    def my_weights(loss_mask: Tensor[N, T], group_index: Tensor[N]) -> Tensor[N, T]

It receives copies of the whole step's mask and groups and returns the per-token weights
w_it (a finite float tensor; weights where the mask is 0 are dropped), which keeps it
exact under every layout. Built-in modes ship only c_i per sample (w_it = m_it · c_i).

Deferred (the training API, several ``forward_backward`` calls before one
``optim_step``, :func:`call_coefficients`): every mode factors as

    J = (1/D) Σ_i c'_i Σ_t m_it ℓ_it    with c'_i known from sample i (or its group) alone
                                         and D a sum over samples (or groups)

    sample_mean  c'_i = 1/M_i      D = N        (each sample adds 1)
    token_mean   c'_i = 1          D = Σ_i M_i  (each sample adds M_i)
    prompt_mean  c'_i = 1/T_g(i)   D = P        (each group adds 1; groups whole per call)
    constant     c'_i = 1          D = L·N      (each sample adds L)

so a call k computes S_k = Σ_{i∈k} c'_i Σ_t m ℓ and its gradient with nothing it cannot
know, and D = Σ_k D_k. The step's J = Σ_k S_k / Σ_k D_k and ∇J = (1/ΣD) Σ_k ∇S_k: the
optimizer step scales the accumulated gradient once by 1/ΣD, before clipping. The
weights are then exactly those of one call on the union (c_i = c'_i / D).

Length bias (:func:`length_bias`, a dashboard view, no backward): sort the step's samples
by (M_i, i) and cut them into the shortest, middle and longest third B_s, B_m, B_l (sizes
as equal as possible and symmetric: N = 3k+1 gives the middle the extra sample, N = 3k+2
gives one to each end). Sample i carries W_i = Σ_t w_it = c_i · M_i of the step's
weight (0 when M_i = 0), and each mode's share of bucket B is

    share_B = Σ_{i∈B} W_i / Σ_i W_i        (all shares 0 when Σ_i W_i = 0)

so the three shares of a mode sum to 1. sample_mean gives each non-empty response
W_i = 1/N: with no empty response its shares are |B|/N whatever the lengths. token_mean
and constant both give W_i ∝ M_i, hence equal shares: they differ in scale (1/ΣM vs
1/(L·N)), not in how the step's weight is split. prompt_mean gives W_i = M_i / (P · T_g):
∝ M_i inside a group, 1/P for each group with a valid token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout.plugins import load_object
from trainer.config import AGGREGATION_MODES, AggregationConfig, AggregationMode

__all__ = [
    "AGGREGATION_MODES",
    "LENGTH_BUCKETS",
    "AggregationConfig",
    "AggregationMode",
    "EmptyStepError",
    "IncompleteGroupError",
    "aggregate",
    "aggregate_all_modes",
    "call_coefficients",
    "custom_reducer_weights",
    "length_bias",
    "load_custom_reducer",
    "local_weighted_sum",
    "sample_coefficients",
    "sample_ids_from_cu_seqlens",
    "sum_reduction_factor",
    "token_weights",
]

WeightFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class IncompleteGroupError(ValueError):
    """prompt_mean needs every group of the step whole (G samples per group_index)."""


class EmptyStepError(ValueError):
    """The step has no valid token: it is skipped and reported, never turned into NaN."""


def sample_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sample id of each token in a packed 1-D layout: cu_seqlens [N+1] -> ids [total]."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)


def _check_groups(group_index: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, int]:
    """Dense group ids 0..P-1 per sample, and P; raises if a group is incomplete."""
    group_ids, dense, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    expected = group_size if group_size is not None else int(counts.max())
    short = (counts != expected).nonzero().flatten()
    if len(short) > 0:
        g = int(short[0])
        raise IncompleteGroupError(
            f"prompt_mean: group {int(group_ids[g])} has {int(counts[g])} of {expected} "
            f"samples in this step; every step must hold whole groups"
        )
    return dense, len(group_ids)


def sample_coefficients(
    sample_token_counts: torch.Tensor,
    group_index: torch.Tensor,
    mode: AggregationMode,
    divisor: float | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """c_i such that w_it = m_it · c_i, from whole-step metadata only: c'_i / D of the
    step as one call (:func:`call_coefficients`, where the per-mode math lives).

    sample_token_counts: M_i [N]; group_index: [N]. Samples (groups) with no valid token
    get c_i = 0 (the division is guarded, they still count in N and P).
    """
    per_call, denominator = call_coefficients(sample_token_counts, group_index, mode,
                                              divisor, group_size)
    return per_call / denominator if denominator > 0 else torch.zeros_like(per_call)


def _nonzero(counts: torch.Tensor) -> torch.Tensor:
    """The counts with 0 replaced by 1, so 1 / counts stays finite where ``torch.where``
    discards it. Not a clamp: M_i of fractional weights may lie in (0, 1)."""
    return torch.where(counts > 0, counts, torch.ones_like(counts))


def call_coefficients(
    sample_token_counts: torch.Tensor,
    group_index: torch.Tensor,
    mode: AggregationMode,
    divisor: float | None = None,
    group_size: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(c'_i [N], D) of one call of a deferred step (module docstring, "Deferred"): the
    per-call coefficients and this call's share of the step's denominator. Summing D over
    the calls of a step and scaling by 1/ΣD gives :func:`sample_coefficients` of their
    union. prompt_mean needs each group whole in the call (every group ``group_size``
    samples; None: the largest group's size)."""
    counts = sample_token_counts.to(torch.float64)
    num_samples = counts.shape[0]
    if mode == "sample_mean":
        return torch.where(counts > 0, 1.0 / _nonzero(counts), 0.0), float(num_samples)
    if mode == "token_mean":
        return torch.ones_like(counts), float(counts.sum())
    if mode == "prompt_mean":
        dense, num_prompts = _check_groups(group_index, group_size)
        totals = torch.zeros(num_prompts, dtype=torch.float64, device=counts.device)
        totals.index_add_(0, dense.to(counts.device), counts)
        group_totals = totals[dense]
        return (torch.where(group_totals > 0, 1.0 / _nonzero(group_totals), 0.0),
                float(num_prompts))
    if mode == "constant":
        if divisor is None or not divisor > 0:
            raise ValueError(f"divisor: mode=constant needs a divisor > 0, got {divisor}")
        return torch.ones_like(counts), float(divisor) * num_samples
    raise ValueError(f"mode: unknown aggregation mode {mode!r}; expected {AGGREGATION_MODES}")


def _per_sample_counts(
    loss_mask: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """M_i, and for a packed layout the sample id of each token."""
    if cu_seqlens is None:
        return loss_mask.to(torch.float64).sum(dim=-1), None
    sample_ids = sample_ids_from_cu_seqlens(cu_seqlens)
    counts = torch.zeros(len(cu_seqlens) - 1, dtype=torch.float64, device=loss_mask.device)
    counts.index_add_(0, sample_ids, loss_mask.to(torch.float64))
    return counts, sample_ids


def token_weights(
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    mode: AggregationMode = "sample_mean",
    divisor: float | None = None,
    *,
    group_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token weights w_it (float64, shaped like loss_mask) so that J = Σ w·ℓ.

    Computed once per step on the whole step's mask ([N, T], or packed [total] with
    cu_seqlens [N+1]); split the weights exactly like the tokens afterwards.
    """
    counts, sample_ids = _per_sample_counts(loss_mask, cu_seqlens)
    coefficients = sample_coefficients(counts, group_index, mode, divisor, group_size)
    per_token = coefficients[:, None] if sample_ids is None else coefficients[sample_ids]
    return loss_mask.to(torch.float64) * per_token


def local_weighted_sum(per_token_loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """This rank's share of J: Σ w·ℓ over the tokens it owns (any shape, same for both).

    Summing this over micro-batches and ranks gives J; backpropagating it and SUMMING the
    gradients over DP×CP ranks gives ∇J.
    """
    return (per_token_loss * weights.to(per_token_loss.dtype)).sum()


def sum_reduction_factor(num_averaging_ranks: int = 1, num_micro_batches_divided: int = 1) -> int:
    """The single factor a backend multiplies its local loss by when its framework averages.

    Tally's contract is a plain SUM of gradients over DP×CP ranks and micro-batches. A
    framework that all-reduces with a mean over R ranks (DDP, FSDP's default) and/or
    divides each micro-batch loss by the number of micro-batches K (Megatron's schedule)
    computes ∇J / (R·K); scaling the local loss by R·K restores ∇J.
    """
    return num_averaging_ranks * num_micro_batches_divided


def aggregate(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    mode: AggregationMode = "sample_mean",
    divisor: float | None = None,
    *,
    group_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference J of one whole step on one process, straight from the formulas.

    per_token_loss, loss_mask: [N, T] (or packed [total] with cu_seqlens [N+1]);
    group_index: [N]. Written per sample and per group, independently of token_weights,
    so the tests can hold one against the other. A step without valid tokens raises
    EmptyStepError.
    """
    counts, sample_ids = _per_sample_counts(loss_mask, cu_seqlens)
    if counts.sum() == 0:
        raise EmptyStepError("the step has no valid token (every loss_mask is 0); skip it")
    masked = per_token_loss * loss_mask.to(per_token_loss.dtype)
    if sample_ids is None:
        sample_sums = masked.sum(dim=-1)
    else:
        sample_sums = torch.zeros(len(counts), dtype=masked.dtype, device=masked.device)
        sample_sums = sample_sums.index_add(0, sample_ids, masked)
    counts = counts.to(masked.dtype)
    num_samples = len(counts)
    if mode == "sample_mean":
        valid = counts > 0
        return (sample_sums[valid] / counts[valid]).sum() / num_samples
    if mode == "token_mean":
        return sample_sums.sum() / counts.sum()
    if mode == "prompt_mean":
        dense, num_prompts = _check_groups(group_index, group_size)
        total = masked.new_zeros(())
        for g in range(num_prompts):
            members = dense == g
            if counts[members].sum() > 0:
                total = total + sample_sums[members].sum() / counts[members].sum()
        return total / num_prompts
    if mode == "constant":
        if divisor is None or not divisor > 0:
            raise ValueError(f"divisor: mode=constant needs a divisor > 0, got {divisor}")
        return sample_sums.sum() / (divisor * num_samples)
    raise ValueError(f"mode: unknown aggregation mode {mode!r}; expected {AGGREGATION_MODES}")


def aggregate_all_modes(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    group_index: torch.Tensor,
    divisor: float | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> dict[str, float]:
    """J under every mode for the same per-token loss (the dashboard's per-mode metric).

    constant uses ``divisor`` or, when none is configured, the padded response length T.
    prompt_mean is left out (NaN) when the step holds incomplete groups.
    """
    if divisor is None:
        divisor = float(loss_mask.shape[-1])
    values: dict[str, float] = {}
    for mode in AGGREGATION_MODES:
        try:
            values[mode] = float(
                aggregate(per_token_loss, loss_mask, group_index, mode, divisor,
                          cu_seqlens=cu_seqlens)
            )
        except IncompleteGroupError:
            values[mode] = float("nan")
    return values


LENGTH_BUCKETS = ("short", "middle", "long")
"""The thirds of a step's responses by valid-token count, in the order length_bias uses."""


def _bucket_of_samples(sample_token_counts: torch.Tensor) -> torch.Tensor:
    """Bucket 0/1/2 (short/middle/long) of each sample: stable sort on M_i, so ties keep
    index order, cut into thirds; a remainder of 1 goes to the middle, of 2 to the ends
    (so short and long always have the same size and compare like for like)."""
    num_samples = len(sample_token_counts)
    base, extra = divmod(num_samples, 3)
    sizes = torch.tensor([base + (extra == 2), base + (extra == 1), base + (extra == 2)])
    order = torch.sort(sample_token_counts, stable=True).indices
    buckets = torch.empty(num_samples, dtype=torch.int64, device=sample_token_counts.device)
    buckets[order] = torch.repeat_interleave(torch.arange(3), sizes).to(buckets.device)
    return buckets


def length_bias(
    sample_token_counts: torch.Tensor,
    group_index: torch.Tensor,
    divisor: float,
    *,
    group_size: int | None = None,
) -> dict[str, tuple[float, float, float]]:
    """Each mode's share of the step's weight on its (short, middle, long) third.

    sample_token_counts: M_i [N]; group_index: [N]; divisor: L of the constant mode.
    O(N log N), from the same c_i as the objective (:func:`sample_coefficients`).
    prompt_mean is NaN when the step holds incomplete groups, as in aggregate_all_modes.
    """
    counts = sample_token_counts.to(torch.float64)
    buckets = _bucket_of_samples(counts)
    shares: dict[str, tuple[float, float, float]] = {}
    for mode in AGGREGATION_MODES:
        try:
            coefficients = sample_coefficients(counts, group_index, mode,
                                               divisor if mode == "constant" else None,
                                               group_size)
        except IncompleteGroupError:
            shares[mode] = (float("nan"),) * 3
            continue
        per_bucket = torch.zeros(3, dtype=torch.float64, device=counts.device)
        per_bucket.index_add_(0, buckets, coefficients * counts)  # W_i = c_i · M_i
        total = float(per_bucket.sum())
        short, middle, long = (float(w) / total if total > 0 else 0.0 for w in per_bucket)
        shares[mode] = (short, middle, long)
    return shares


def load_custom_reducer(path: str) -> WeightFn:
    """Import ``module:function``; errors name the field."""
    return load_object(path, "custom_reducer")


def custom_reducer_weights(path: str, loss_mask: torch.Tensor,
                           group_index: torch.Tensor) -> torch.Tensor:
    """The weights of a user's reducer (``module:function``) for a whole step, float64.

    It gets copies of the mask and groups (it cannot corrupt the batch) and must return a
    floating-point tensor shaped like the mask, finite; weights where the mask is 0 are
    dropped. Anything else raises a ``ValueError`` naming the field.
    """
    weights = load_custom_reducer(path)(loss_mask.clone(), group_index.clone())
    field = f"custom_reducer: {path}"
    if not isinstance(weights, torch.Tensor):
        raise ValueError(f"{field} must return a torch.Tensor, got {type(weights).__name__}")
    if not weights.is_floating_point():
        raise ValueError(f"{field} must return floating-point weights, got {weights.dtype}")
    if weights.shape != loss_mask.shape or not torch.isfinite(weights).all():
        raise ValueError(
            f"{field} must return finite weights of shape {tuple(loss_mask.shape)}, got "
            f"{tuple(weights.shape)}"
        )
    return weights.detach().to(torch.float64) * (loss_mask != 0)
