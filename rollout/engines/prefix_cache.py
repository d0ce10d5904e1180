"""The torch engine's kept KV: each episode's cache between its environment turns.

An episode's turn t + 1 is its turn-t context, the action sampled, and the observation
appended (rollout/episodes.py: token ids are never re-tokenized), so the KV of every
position but the last the engine computed for turn t is the KV of a prefix of turn
t + 1's context. Kept, only what follows it is prefilled:

    turn t:      [context_t ················][action_t]        kept: context_t + action_t[:-1]
    turn t + 1:  [context_t + action_t[:k]  ][observation]     prefilled: what the kept
                  └ longest common prefix ─┘                   prefix does not cover

(k < len(action_t) when the turn's budget cut the action; the last sampled token is
never fed, so it is always prefilled.) Keys are the token ids themselves, so an entry is
found whichever engine call, chunk or row the episode lands in, and a wrong match is
impossible: the same ids at the same positions under the same weights have the same KV.

What is kept, and for how long:

- at most ``max_bytes`` (``rollout.engine.prefix_cache_mb``), least recently used out
  first; 0 keeps nothing (every turn prefills its whole context, as without a cache);
- an entry is taken by the turn that continues it (the episode moved on) and by the
  episode's last turn (it ended);
- a set of episodes (one rollout's draw, an evaluation) drops what another set kept, and
  a turn drops what was kept two turns before it (no call of the turn between took it:
  its episode ended in the environment);
- everything goes when the weights change: a new version, a bucket, a disk load, an
  adapter (the engine calls :meth:`PrefixCache.clear`, and checks the version it was
  filled under before each use).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per decoder layer, (keys, values) of one sequence: each [kv_heads, length, head_dim]."""


@dataclass(frozen=True)
class KeptKV:
    """The KV of one sequence's tokens, kept for the turn that continues it."""

    tokens: tuple[int, ...]
    layers: LayerKV
    episodes: str
    """The set of episodes it belongs to (rollout/engines/base.EpisodeTurn.episodes)."""
    turn: int
    """The turn that computed it."""
    num_context: int
    """How many of ``tokens`` were that turn's context (the rest its action): a match
    that covers them continues this entry's episode, a shorter one is a sibling's
    (another sample of the same prompt) and leaves the entry to its own episode."""

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)


class PrefixCache:
    """A byte-bounded LRU of kept KV, looked up by the longest common prefix of ids."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], KeptKV] = OrderedDict()
        self.num_bytes = 0
        self.weight_version: int | None = None
        """The weights the entries were computed with (None: empty)."""

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def clear(self) -> None:
        self.entries.clear()
        self.num_bytes = 0
        self.weight_version = None

    def begin_turn(self, episodes: str, turn: int, weight_version: int) -> None:
        """Drop what this turn can never use: other weights, other episodes, or an entry
        two turns old (an ended episode's)."""
        if self.weight_version != weight_version:
            self.clear()
            self.weight_version = weight_version
        for key in [k for k, e in self.entries.items()
                    if e.episodes != episodes or e.turn < turn - 1]:
            self._remove(key)

    def longest(self, contexts: Sequence[Sequence[int]]
                ) -> list[tuple[int, KeptKV | None]]:
        """Per context, (the length of its longest common prefix with an entry, that
        entry), or (0, None). All entries are compared at once, one context at a time."""
        if not self.entries:
            return [(0, None) for _ in contexts]
        kept = list(self.entries.values())
        width = max(len(e.tokens) for e in kept)
        ids_EW = torch.full((len(kept), width), -1, dtype=torch.long)
        for i, entry in enumerate(kept):
            ids_EW[i, :len(entry.tokens)] = torch.tensor(entry.tokens)
        out: list[tuple[int, KeptKV | None]] = []
        for context in contexts:
            n = min(width, len(context))
            same_EN = ids_EW[:, :n] == torch.tensor(context[:n])
            common_E = same_EN.cumprod(dim=1).sum(dim=1)
            best = int(common_E.argmax())
            length = int(common_E[best])
            out.append((length, kept[best]) if length > 0 else (0, None))
        return out

    def take(self, matches: Sequence[tuple[int, KeptKV | None]]) -> None:
        """Remove the entries that (length, entry) matches continued: their episodes
        have moved on (or ended)."""
        for length, entry in matches:
            if (entry is not None and length >= entry.num_context
                    and self.entries.get(entry.tokens) is entry):
                self._remove(entry.tokens)

    def put(self, entry: KeptKV) -> None:
        """Keep ``entry``, evicting the least recently kept past ``max_bytes`` (an entry
        larger than the whole budget is not kept)."""
        size = entry.num_bytes
        if not self.enabled or size > self.max_bytes:
            return
        if entry.tokens in self.entries:  # two rows sampled the same sequence
            self._remove(entry.tokens)
        while self.entries and self.num_bytes + size > self.max_bytes:
            self._remove(next(iter(self.entries)))
        self.entries[entry.tokens] = entry
        self.num_bytes += size

    def _remove(self, key: tuple[int, ...]) -> None:
        self.num_bytes -= self.entries.pop(key).num_bytes
