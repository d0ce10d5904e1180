"""Preference pairs on their way to the ranks: tokenized once by rollout/reward_text.py
(the one tokenization the reward actors share: ``apply_chat_template(tokenize=True)`` or
the text with special tokens added once; over max_length, left truncation keeping the
leading special tokens and template prefix), then cut into steps. A sequence's score is
read at its last id (trainer/pair_batch.py), whatever the pad token.

Order: epoch e visits every train pair once in a shuffled order that depends only on
(seed, e); step s takes positions s·P … s·P + P − 1 of the epochs laid end to end, so
every step has exactly P pairs (the last of an epoch runs into the next) and a run is
the same whatever else changes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from rollout.preference_pairs import PreferenceDataError, PreferencePair
from rollout.reward_text import encode_reward
from trainer.pair_batch import PairBatch


@dataclass(frozen=True)
class TokenizedPairs:
    """Pairs as the token ids their scores are read from."""

    sequences: list[tuple[list[int], list[int]]]
    """(chosen ids, rejected ids) per pair, in file order."""
    kinds: list[str | None]
    """Each pair's ``kind`` (None when the file gives none)."""
    num_truncated: int
    """Texts longer than max_length, cut by left truncation (rollout/reward_text.py)."""
    margins: list[float] | None = None
    """Each pair's margin m (data.margin), None when the run reads none."""

    def __len__(self) -> int:
        return len(self.sequences)

    def batch(self, indices: list[int], pad_id: int) -> PairBatch:
        margins = None if self.margins is None else [self.margins[i] for i in indices]
        return PairBatch.from_sequences([self.sequences[i] for i in indices], pad_id,
                                        margins)

    def num_tokens(self, indices: list[int]) -> int:
        return sum(len(ids) for i in indices for ids in self.sequences[i])


def tokenize_pairs(pairs: list[PreferencePair], tokenizer: Any, chat_template: bool,
                   max_length: int, with_margins: bool = False) -> TokenizedPairs:
    """Both texts of every pair in the reward model's tokens (rollout/reward_text.py);
    PreferenceDataError naming the record when a text has no token at all."""
    sequences, truncated = [], 0
    for pair in pairs:
        sides = []
        for field, response in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            encoded = encode_reward(tokenizer, pair.prompt, response, chat_template,
                                    max_length, "left")
            if not encoded.ids:
                raise PreferenceDataError(f'{pair.where}: "{field}": its text has no token '
                                          "to score")
            truncated += encoded.truncated
            sides.append(encoded.ids)
        sequences.append((sides[0], sides[1]))
    return TokenizedPairs(sequences, [pair.kind for pair in pairs], truncated,
                          [pair.margin for pair in pairs] if with_margins else None)


def step_indices(num_pairs: int, pairs_per_step: int, step: int, seed: int) -> list[int]:
    """The train pairs of optimizer step ``step`` (module docstring)."""
    indices = []
    for position in range(step * pairs_per_step, (step + 1) * pairs_per_step):
        epoch, within = divmod(position, num_pairs)
        indices.append(epoch_order(num_pairs, epoch, seed)[within])
    return indices


_orders: dict[tuple[int, int, int], list[int]] = {}


def epoch_order(num_pairs: int, epoch: int, seed: int) -> list[int]:
    """A permutation of the pairs for ``epoch`` (a string-seeded ``random.Random``: the
    same on every machine and Python)."""
    key = (num_pairs, epoch, seed)
    if key not in _orders:
        order = list(range(num_pairs))
        random.Random(f"train-rm:{seed}:{epoch}").shuffle(order)
        _orders.clear()  # one epoch at a time is all a run asks for
        _orders[key] = order
    return _orders[key]
