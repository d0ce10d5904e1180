"""Train / held-out splits by content: a record's split is a hash of its canonical text.

Why a hash and not a position or a second seed: membership is a function of the text
alone, so the two splits are disjoint for every seed and every size, a record drawn twice
lands in the same split, and asking for more prompts never moves one across. sha256 (not
``hash()``, which PYTHONHASHSEED salts) gives the same split on every machine and process.

    split_of(text) = "heldout"  when  int(sha256(text)[:8]) mod 100 < HELDOUT_PERCENT
    split_by_fraction(text, f) = "heldout"  when  int(sha256(text)[:8]) < f · 2^64
                                 (a user's file: eval.split_fraction)
"""

from __future__ import annotations

import hashlib

from rollout.config import DatasetSplit

HELDOUT_PERCENT = 20
"""Share of all possible records that is held out, in percent."""


def split_of(text: str) -> DatasetSplit:
    """The split a record with this canonical text belongs to."""
    bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def split_by_fraction(text: str, heldout_fraction: float) -> DatasetSplit:
    """The side of a ``heldout_fraction`` split a record with this text is on."""
    value = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return "heldout" if value < heldout_fraction * 2**64 else "train"
