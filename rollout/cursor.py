"""Where rollout stands in its dataset: position within the epoch, epoch, shuffle seed.

Epoch e visits the records in ``permutation(seed, e)``: a pure function of (seed, e),
so the state that a resume needs is three integers and a resumed run draws exactly the
prompts the uninterrupted run would have drawn.
"""

from __future__ import annotations

import random
from typing import Any


class PromptCursor:
    """Hands out dataset indices, epoch after epoch, optionally reshuffled each epoch."""

    def __init__(self, num_items: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_items <= 0:
            raise ValueError(f"num_items: must be > 0, got {num_items}")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_items))
        if self.shuffle:
            # An integer seed keeps random.Random portable across Python builds.
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        """The next `count` indices; crosses into the next epoch (reshuffled) as needed."""
        indices: list[int] = []
        while len(indices) < count:
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            end = min(self.num_items, self.position + count - len(indices))
            indices.extend(self._order[self.position : end])
            self.position = end
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_items": self.num_items,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved position; the dataset size must not have changed."""
        if state["num_items"] != self.num_items:
            raise ValueError(
                f"cursor: saved for a dataset of {state['num_items']} records, but this one "
                f"has {self.num_items}; a resume needs the same dataset"
            )
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
