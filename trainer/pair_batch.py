"""Preference pairs as the trainer sees them: a typed batch, its step plan (whole pairs
to DP ranks and micro-batches) and one micro-batch's rows.

Row 2p of a :class:`PairBatch` is pair p's chosen sequence, row 2p + 1 its rejected one.
The plan never splits a pair: both sequences go to one micro-batch of one DP rank, so a
pair's loss term (Bradley–Terry with its margin, and centring) is computed where both of
its scores are (trainer/bradley_terry.py); a pair's margin travels with it.

Ranks get pairs by longest-first greedy balancing of their tokens; each rank's pairs, in
batch order, fill micro-batches of at most ``max_tokens`` tokens: real tokens of one
packed row, or ``rows × longest`` of a padded micro-batch. Every rank gets as many
micro-batches as the busiest (empty ones: FSDP's collectives stay in step).

A packed micro-batch is one row [1, Σ L] of its sequences back to back, positions
restarting at 0 for each (``RowLayout``: attention never crosses a sequence); a padded
one is [2k, longest], right-padded (a real token never sees the padding after it). Either
way a sequence's score is read at its last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.row_layout import RowLayout


@dataclass(frozen=True)
class PairBatch:
    """P pairs' token ids; validated when built."""

    input_ids_NS: torch.Tensor
    """int64 [2P, S]: row 2p pair p's chosen, row 2p + 1 its rejected, right-padded."""
    lengths_N: torch.Tensor
    """int64 [2P]: tokens of each sequence (≥ 1); its score is read at lengths − 1."""
    margin_P: torch.Tensor | None = None
    """float64 [P]: pair p's margin m_p in −log σ(r⁺ − r⁻ − m_p) (trainer/bradley_terry.py);
    None: every margin 0."""

    def __post_init__(self) -> None:
        ids, lengths = self.input_ids_NS, self.lengths_N
        if ids.dim() != 2 or lengths.shape != ids.shape[:1] or ids.shape[0] % 2:
            raise ValueError(f"pair batch: input_ids [2P, S] and lengths [2P], got "
                             f"{tuple(ids.shape)} and {tuple(lengths.shape)}")
        if ids.shape[0] and (int(lengths.min()) < 1 or int(lengths.max()) > ids.shape[1]):
            raise ValueError("pair batch: every length is between 1 and the row width")
        margin = self.margin_P
        if margin is not None and (margin.shape != (self.num_pairs,)
                                   or margin.dtype != torch.float64
                                   or not bool(torch.isfinite(margin).all())):
            raise ValueError(f"pair batch: margin is finite float64 [P = {self.num_pairs}], "
                             f"got {margin.dtype} {tuple(margin.shape)}")

    @property
    def num_pairs(self) -> int:
        return self.input_ids_NS.shape[0] // 2

    @classmethod
    def from_sequences(cls, pairs: list[tuple[list[int], list[int]]], pad_id: int,
                       margins: list[float] | None = None) -> PairBatch:
        """(chosen ids, rejected ids) per pair, right-padded with ``pad_id``; ``margins``:
        each pair's m_p (None: all 0)."""
        sequences = [ids for pair in pairs for ids in pair]
        lengths = torch.tensor([len(ids) for ids in sequences], dtype=torch.int64)
        width = int(lengths.max()) if len(sequences) else 1
        input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.int64)
        for row, ids in enumerate(sequences):
            input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        margin = None if margins is None else torch.tensor(margins, dtype=torch.float64)
        return cls(input_ids, lengths, margin)


@dataclass(frozen=True)
class PairPlan:
    """Which pairs each DP rank computes, micro-batch by micro-batch."""

    num_pairs: int
    """P: the step's divisor."""
    packed: bool
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    """[dp_rank][k]: the pairs of that rank's k-th micro-batch; every rank has as many
    (an empty one keeps FSDP's collectives in step)."""
    computed_tokens: int
    """Tokens the ranks run through the model (padding included), all ranks."""


def _cost(lengths: list[int], packed: bool) -> int:
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def plan_pairs(lengths_N: torch.Tensor, dp_size: int, max_tokens: int, packed: bool
               ) -> PairPlan:
    """The step plan of a batch whose sequences have ``lengths_N`` (module docstring);
    ValueError when one pair alone is over ``max_tokens``."""
    lengths = lengths_N.tolist()
    num_pairs = len(lengths) // 2
    sizes = [lengths[2 * p] + lengths[2 * p + 1] for p in range(num_pairs)]
    load, owned = [0] * dp_size, [[] for _ in range(dp_size)]
    for p in sorted(range(num_pairs), key=lambda p: (-sizes[p], p)):
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        load[rank] += sizes[p]
        owned[rank].append(p)
    per_rank, computed = [], 0
    for pairs in owned:
        micro: list[list[int]] = []
        current: list[int] = []
        for p in sorted(pairs):
            pair = [lengths[2 * p], lengths[2 * p + 1]]
            if _cost(pair, packed) > max_tokens:
                raise ValueError(f"pair {p}: {_cost(pair, packed)} tokens do not fit a "
                                 f"micro-batch of {max_tokens}")
            seqs = [lengths[s] for q in current for s in (2 * q, 2 * q + 1)]
            if current and _cost(seqs + pair, packed) > max_tokens:
                micro.append(current)
                computed += _cost(seqs, packed)
                current = []
            current.append(p)
        if current:
            micro.append(current)
            computed += _cost([lengths[s] for q in current for s in (2 * q, 2 * q + 1)],
                              packed)
        per_rank.append(micro)
    most = max(len(m) for m in per_rank)
    micro_batches = tuple(tuple(tuple(m) for m in rank) + ((),) * (most - len(rank))
                          for rank in per_rank)
    return PairPlan(num_pairs, packed, micro_batches, computed)


@dataclass
class PairMicroBatch:
    """One micro-batch's rows (what ``FSDPWorker._forward`` reads) and where each
    sequence's score is, in order chosen₀, rejected₀, chosen₁, …"""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: RowLayout | None
    """Packed: the row's layout (attention's mask); None: padded rows."""
    score_rows: torch.Tensor
    score_cols: torch.Tensor
    weight: float
    """1, or 0 for an empty micro-batch (pair 0 run for nothing)."""
    margin: torch.Tensor | None = None
    """float64 [k]: these pairs' margins m_p, in order (None: all 0)."""

    def to(self, device: torch.device) -> PairMicroBatch:
        return PairMicroBatch(self.input_ids.to(device), self.position_ids.to(device),
                              None if self.layout is None else self.layout.to(device),
                              self.score_rows.to(device), self.score_cols.to(device),
                              self.weight,
                              None if self.margin is None else self.margin.to(device))


def slice_pairs(batch: PairBatch, pairs: tuple[int, ...], packed: bool) -> PairMicroBatch:
    """The rows of ``pairs`` (empty: pair 0 with weight 0), packed or padded, with their
    margins."""
    index = torch.tensor([s for p in (pairs or (0,)) for s in (2 * p, 2 * p + 1)])
    lengths = batch.lengths_N[index]
    weight = 1.0 if pairs else 0.0
    margin = None if batch.margin_P is None else batch.margin_P[index[0::2] // 2]
    if packed:
        layout = RowLayout.build(lengths)
        row = torch.cat([batch.input_ids_NS[i, :n] for i, n in zip(index.tolist(),
                                                                   lengths.tolist(),
                                                                   strict=True)])
        ends = torch.cumsum(lengths, 0) - 1
        return PairMicroBatch(row[None], layout.position_T[None], layout,
                              torch.zeros_like(ends), ends, weight, margin)
    width = int(lengths.max())
    positions = torch.arange(width)[None].expand(len(index), -1).contiguous()
    return PairMicroBatch(batch.input_ids_NS[index, :width], positions, None,
                          torch.arange(len(index)), lengths - 1, weight, margin)
