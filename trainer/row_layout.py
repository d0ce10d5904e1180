r"""The layout of one packed row, as one object: built where the row is cut
(``micro_batch.slice_packed_row``), handed to attention and CP sharding, checked there.

A row holds n samples ("slots") back to back. Slot s is sample i with L_s tokens
(positions 0 … L_s − 1). A slot may leave its first ``start_s`` tokens to its head h(s)
(an earlier slot of the same group whose prompt is identical: the shared prefix) and
then holds only positions start_s … L_s − 1; it reads the head's keys at positions
< prefix_s (= start_s; one more under the ``prefix_mask`` test hook). Under context
parallelism each slot is rounded up to 2·cp and zigzag-sharded on its own (chunks r and
2·cp − 1 − r of rank r; CP padding keeps counting positions); a shared prefix needs
cp 1. What a query q may see, for every kernel (SDPA pieces, the dense mask, FlexAttention):

    visible(q, k) = pos(k) ≤ pos(q) ∧ pos(q) − pos(k) < window
                    ∧ (slot(k) = slot(q) ∨ (slot(k) = h(slot(q)) ∧ pos(k) < prefix(slot(q))))

(window = ∞ for full-attention layers: Hugging Face's sliding window, kv > q − window).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch


def visible(q_slot: torch.Tensor, q_pos: torch.Tensor, k_slot: torch.Tensor,
            k_pos: torch.Tensor, q_head: torch.Tensor, q_prefix: torch.Tensor,
            window: int | None = None) -> torch.Tensor:
    """The one mask (module docstring), elementwise and broadcasting: FlexAttention's
    mask_mod calls it on gathered indices, the SDPA paths on [T, 1] × [1, T_k] tensors."""
    seen = (k_pos <= q_pos) & ((k_slot == q_slot) | ((k_slot == q_head) & (k_pos < q_prefix)))
    if window is not None:
        seen = seen & (q_pos - k_pos < window)
    return seen


def _chunks(lengths_N: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Tokens per zigzag chunk of each slot: L rounded up to 2·cp, over 2·cp (L at cp 1)."""
    if cp_size == 1:
        return lengths_N
    return (lengths_N + 2 * cp_size - 1) // (2 * cp_size)


def packed_row_index(lengths: torch.Tensor, cp_size: int, cp_rank: int,
                     skips: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, position) of every token of a CP rank's shard of a packed row whose samples
    have ``lengths``: each sample rounded up to 2·cp, cut into 2·cp chunks, chunks r and
    2·cp−1−r kept (zigzag_shard per sample, vectorized). Positions ≥ a sample's length
    are its CP padding (they keep counting, as zigzag_positions does). ``skips`` (shared
    prefix, CP 1): a sample's tokens start at position skips[slot]."""
    shared = skips is not None and bool(skips.any())
    if shared and cp_size > 1:
        raise ValueError("shared_prefix: needs cp_size 1")
    chunk = _chunks(lengths, cp_size)
    if shared:
        chunk = chunk - skips
    local = chunk * 2 if cp_size > 1 else chunk
    slot = torch.repeat_interleave(torch.arange(len(lengths)), local)
    within = torch.arange(int(local.sum())) - torch.repeat_interleave(
        torch.cumsum(local, 0) - local, local)
    if cp_size == 1:
        return slot, (within + skips[slot] if shared else within)
    c = chunk[slot]
    first = within < c
    position = torch.where(first, cp_rank * c + within,
                           (2 * cp_size - 1 - cp_rank) * c + within - c)
    return slot, position


@dataclass(frozen=True, eq=False)
class RowLayout:
    """One packed row as this CP rank holds it (module docstring). Per-slot tensors are
    int64 [n]; per-token ones [T_local], in row order."""

    lengths_N: torch.Tensor
    """L_s: the slot's sample length (its positions are 0 … L_s − 1, CP padding after)."""
    starts_N: torch.Tensor
    """The first position the slot holds (0, or what it leaves to its head)."""
    heads_N: torch.Tensor
    """h(s): the slot whose prompt it reads (itself when it reads none)."""
    prefix_N: torch.Tensor
    """It sees its head's keys at positions < prefix_N[s] (starts_N, or +1 planted)."""
    slot_T: torch.Tensor
    position_T: torch.Tensor
    cp_size: int = 1
    cp_rank: int = 0

    @classmethod
    def build(cls, lengths_N: torch.Tensor, cp_size: int = 1, cp_rank: int = 0,
              starts_N: torch.Tensor | None = None, heads_N: torch.Tensor | None = None,
              planted: bool = False) -> RowLayout:
        """The layout of slots of ``lengths_N`` (per-slot work plus two vectorized index
        computations over the tokens); ``starts_N``/``heads_N``: a shared prefix;
        ``planted``: the ``prefix_mask`` test hook (trainer/planted.py), handed in by the
        rank that plants it (a follower also sees its head's key at position start_s)."""
        lengths_N = lengths_N.to(torch.int64)
        n = len(lengths_N)
        own = torch.arange(n)
        starts = torch.zeros(n, dtype=torch.int64) if starts_N is None else starts_N.to(
            torch.int64)
        heads = own if heads_N is None else heads_N.to(torch.int64)
        slot, position = packed_row_index(lengths_N, cp_size, cp_rank,
                                          starts if starts_N is not None else None)
        prefix = starts + (starts > 0) if planted else starts
        return cls(lengths_N, starts, heads, prefix, slot, position, cp_size, cp_rank)

    @property
    def num_slots(self) -> int:
        return len(self.lengths_N)

    @functools.cached_property
    def shares_prefix(self) -> bool:
        return bool((self.starts_N > 0).any())

    @functools.cached_property
    def span(self) -> int:
        """1 + the largest position of the whole row (all CP ranks): no query is further
        than span − 1 from a key it sees, so a window ≥ span changes nothing."""
        return int(_chunks(self.lengths_N, self.cp_size).max()) * (
            2 * self.cp_size if self.cp_size > 1 else 1) if self.num_slots else 0

    def local_counts(self) -> list[int]:
        """Tokens of each slot in this rank's shard, as a list (the SDPA pieces' plan)."""
        chunk = _chunks(self.lengths_N, self.cp_size)
        return (chunk * 2 if self.cp_size > 1 else chunk - self.starts_N).tolist()

    def check_slots(self) -> None:
        """Heads and followers (per slot): a head inside the row and before its
        followers, itself a head, holding the prompt it lends; ValueError naming the slot."""
        n, heads, starts = self.num_slots, self.heads_N.tolist(), self.starts_N.tolist()
        lengths, prefix = self.lengths_N.tolist(), self.prefix_N.tolist()
        for s, (h, start) in enumerate(zip(heads, starts, strict=True)):
            if not 0 <= h < n:
                raise ValueError(f"row layout: slot {s}: its head {h} is outside the row's "
                                 f"{n} slots")
            if h == s:
                if start:
                    raise ValueError(f"row layout: slot {s} starts at position {start} but "
                                     f"reads no head's prompt")
                continue
            if self.cp_size > 1:
                raise ValueError(f"row layout: slot {s} shares slot {h}'s prompt, which "
                                 f"needs cp_size 1 (cp_size={self.cp_size})")
            if h > s:
                raise ValueError(f"row layout: slot {s} (a follower) comes before its head, "
                                 f"slot {h}")
            if heads[h] != h:
                raise ValueError(f"row layout: slot {s} reads slot {h}, itself a follower")
            if not 0 < start < lengths[s] or prefix[s] > lengths[h]:
                raise ValueError(f"row layout: slot {s} starts at {start} of its {lengths[s]} "
                                 f"tokens and reads {prefix[s]} of slot {h}'s {lengths[h]}")

    def check(self, position_ids: torch.Tensor | None = None) -> None:
        """Where the row is used: the slots (``check_slots``), the tokens' spans (each
        slot's tokens contiguous, in slot order, as many as it holds) and positions (the
        row's, and those the model is given); ValueError naming the slot. The layout is
        frozen, so its own invariants are checked once (the policy's and the reference
        model's forwards share it); the given positions every time."""
        if not self.__dict__.get("_checked"):
            self._check_layout()
            self.__dict__["_checked"] = True  # frozen: the cache bypasses __setattr__
        if position_ids is not None and not torch.equal(position_ids.reshape(-1),
                                                        self.position_T):
            self._check_layout(position_ids)

    def _check_layout(self, position_ids: torch.Tensor | None = None) -> None:
        self.check_slots()
        slot, position = packed_row_index(self.lengths_N.cpu(), self.cp_size, self.cp_rank,
                                          self.starts_N.cpu() if self.shares_prefix else None)
        mine = self.slot_T.cpu()
        if not torch.equal(mine, slot):
            i = _first_difference(mine, slot)
            owner = int(slot[i]) if i < len(slot) else int(mine[i])
            raise ValueError(f"row layout: slot {owner}: token {i} of the row belongs to slot "
                             f"{int(mine[i]) if i < len(mine) else None} (spans overlap or "
                             f"leave a gap)")
        for given in (self.position_T.cpu(),
                      None if position_ids is None else position_ids.reshape(-1).cpu()):
            if given is not None and not torch.equal(given, position):
                i = _first_difference(given, position)
                raise ValueError(f"row layout: slot {int(slot[min(i, len(slot) - 1)])}: token "
                                 f"{i} has position {_at(given, i)}, the row's is "
                                 f"{_at(position, i)}")

    @functools.cached_property
    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, position) of the keys a rank attends to: every CP rank's tokens in rank
        order (as all-gathered), computed here rather than communicated."""
        if self.cp_size == 1:
            return self.slot_T, self.position_T
        parts = [packed_row_index(self.lengths_N.cpu(), self.cp_size, r)
                 for r in range(self.cp_size)]
        device = self.slot_T.device
        return (torch.cat([s for s, _ in parts]).to(device),
                torch.cat([p for _, p in parts]).to(device))

    def dense_mask(self, window: int | None = None) -> torch.Tensor:
        """[T_local, T_keys] bool: ``visible`` for every (query, key) of the row."""
        k_slot, k_pos = self.keys
        q = self.slot_T
        return visible(q[:, None], self.position_T[:, None], k_slot[None, :], k_pos[None, :],
                       self.heads_N[q][:, None], self.prefix_N[q][:, None], window)

    def mask_mod(self, length: int, window: int | None = None
                 ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                               torch.Tensor]:
        """FlexAttention's mask_mod over the row padded to ``length`` tokens (cp 1). The
        padding is one more slot n, positions counting on: it sees only itself, and no
        real query sees it."""
        pad = length - len(self.slot_T)
        device = self.slot_T.device
        n = self.num_slots
        slot = torch.cat([self.slot_T, torch.full((pad,), n, device=device)])
        position = torch.cat([self.position_T, torch.arange(pad, device=device)])
        heads = torch.cat([self.heads_N, torch.tensor([n], device=device)])
        prefix = torch.cat([self.prefix_N, torch.zeros(1, dtype=torch.int64, device=device)])

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                     ) -> torch.Tensor:
            q_slot = slot[q]
            return visible(q_slot, position[q], slot[k], position[k], heads[q_slot],
                           prefix[q_slot], window)

        return mask_mod

    def to(self, device: torch.device | str) -> RowLayout:
        """The same layout with its tensors on ``device`` (cached views recomputed)."""
        if self.slot_T.device == torch.device(device):
            return self
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                 for k, v in moved.items()}
        return RowLayout(**moved)


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    common = min(len(a), len(b))
    differ = (a[:common] != b[:common]).nonzero()
    return int(differ[0]) if len(differ) else common


def _at(x: torch.Tensor, i: int) -> int | None:
    return int(x[i]) if i < len(x) else None
