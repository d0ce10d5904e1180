"""Preference pairs: JSONL records ``{"prompt", "chosen", "rejected"}``, what
``tally train-rm`` trains a reward model on.

``prompt`` is a string or a list of chat messages (``{"role", "content"}``), ``chosen``
and ``rejected`` are the two responses to it, the first preferred. An optional ``kind``
(a string) names the sort of pair (e.g. how the rejected response is wrong) so held-out
accuracy can be reported per kind. When the run names a margin column (``data.margin``,
``"margin"`` by default), every record has it: a finite number m, the margin by which the
chosen response should win (−log σ(r⁺ − r⁻ − m), TRL's ``RewardTrainer`` column);
without one, a ``margin`` key is ignored like any other. A file is read whole before
anything starts: the first bad record is refused in one line naming the file, the line
and the field (``data/pairs.jsonl line 7: missing "chosen"``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUIRED = ("prompt", "chosen", "rejected")


class PreferenceDataError(ValueError):
    """A preference file that cannot be trained on; the message is one line."""


@dataclass(frozen=True)
class PreferencePair:
    """One record: ``chosen`` is preferred to ``rejected`` as a response to ``prompt``."""

    prompt: str | list[dict[str, Any]]
    chosen: str
    rejected: str
    kind: str | None = None
    """The pair's kind, when the file says (per-kind held-out accuracy)."""
    where: str = ""
    """``<path> line <n>``: where the record is, for what is said about it later."""
    margin: float = 0.0
    """m in −log σ(r⁺ − r⁻ − m) (trainer/bradley_terry.py): the record's margin column, 0
    when the run reads none."""


def _messages_problem(prompt: list[Any]) -> str | None:
    if not prompt:
        return "is an empty list of messages"
    for i, message in enumerate(prompt):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return f"message {i} is not {{\"role\": str, \"content\": str}}"
    return None


def _margin(record: dict[str, Any], key: str, where: str) -> float:
    if key not in record:
        raise PreferenceDataError(f'{where}: missing "{key}" (the margin column, '
                                  "data.margin)")
    value = record[key]
    try:  # bool is an int to Python, not a margin; a huge int overflows a float
        margin = float(value) if isinstance(value, int | float) and not isinstance(
            value, bool) else math.nan
    except OverflowError:
        margin = math.nan
    if not math.isfinite(margin):
        raise PreferenceDataError(f'{where}: "{key}" (the margin) must be a finite number, '
                                  f"got {json.dumps(value)[:40]}")
    return margin


def parse_pair(line: str, where: str, margin_key: str | None = None) -> PreferencePair:
    """One JSONL line as a pair, its margin read from ``margin_key`` when given;
    PreferenceDataError starting with ``where``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PreferenceDataError(f"{where}: not valid JSON ({err.msg}, column "
                                  f"{err.colno})") from None
    if not isinstance(record, dict):
        raise PreferenceDataError(f"{where}: expected a JSON object with "
                                  f"{', '.join(map(json.dumps, REQUIRED))}")
    for key in REQUIRED:
        if key not in record:
            raise PreferenceDataError(f'{where}: missing "{key}"')
    prompt = record["prompt"]
    if isinstance(prompt, list):
        problem = _messages_problem(prompt)
        if problem:
            raise PreferenceDataError(f'{where}: "prompt" {problem}')
    elif not isinstance(prompt, str):
        raise PreferenceDataError(f'{where}: "prompt" must be a string or a list of chat '
                                  f"messages, got {type(prompt).__name__}")
    for key in ("chosen", "rejected"):
        if not isinstance(record[key], str):
            raise PreferenceDataError(f'{where}: "{key}" must be a string, got '
                                      f"{type(record[key]).__name__}")
    kind = record.get("kind")
    if kind is not None and not isinstance(kind, str):
        raise PreferenceDataError(f'{where}: "kind" must be a string, got '
                                  f"{type(kind).__name__}")
    margin = 0.0 if margin_key is None else _margin(record, margin_key, where)
    return PreferencePair(prompt, record["chosen"], record["rejected"], kind, where, margin)


def read_preference_pairs(path: str | Path, field: str = "",
                          margin_key: str | None = None) -> list[PreferencePair]:
    """Every record of a JSONL file (blank lines skipped), or PreferenceDataError in one
    line: ``<path> line <n>: <what is wrong>`` (``field``: the config field that named the
    file, said when the file is missing or holds no pair; ``margin_key``: the margin
    column every record must have, None: no margin)."""
    path = Path(path)
    named = f"{field}: " if field else ""
    if not path.is_file():
        raise PreferenceDataError(f"{named}{path}: no such file")
    pairs = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PreferenceDataError(f"{path} line {number}: not UTF-8 text") from None
        if line.strip():
            pairs.append(parse_pair(line, f"{path} line {number}", margin_key))
    if not pairs:
        raise PreferenceDataError(f"{named}{path}: holds no preference pair")
    return pairs
