r"""A judge's answer read as a score (``rollout.reward`` ``type: judge``, ``parse``).

    0-10      the LAST number of the answer that stands as a score, divided by 10:
              score  := label? sign? digits ("." digits)? scale?
              label  := ("score" | "rating" | "grade") ("is" | "of" | ":" | "=")?
              scale  := ("/" | "out of") 10        (one unit: "8/10", "7 out of 10")
              stands := not glued to a word, a decimal point, a thousands comma, a slash
                        or a dash before it ("v2", "1.2.3", "1,000", "4/5", "5-7"), nor
                        followed by a word character, "/", "-", "%" or a further decimal
                        ("7th", "8/100", "70%"); a sentence's period after it is fine
                        ("I give it a 7.")
              A score marked by a label or a scale outranks a bare number: the last
              marked one is taken ("Score: 7. It has 3 errors." -> 0.7), else the last
              bare one ("I give it a 7." -> 0.7; "On a scale of 0 to 10, this is a 9"
              -> 0.9, the last number, not "0");
              decimals count ("7.5" -> 0.75). The value must lie in [0, 10]: "-3" and
              "42" are unparsed (the last number decides; an earlier one is not tried).
    yes-no    the first word: yes 1, no 0
    "regex"   a string: its first group as a float, checked finite
    {regex, min, max}   the same, checked finite and inside [min, max]

A score that is not finite (``nan``, ``inf``) or outside its range is unparsed, as an
answer without one: :func:`parse_score` returns None and the sample is unscored (missing,
never a zero reward; rollout/reward_parts/rewarder.py).
"""

from __future__ import annotations

import math
import re

from rollout.reward_config import BUILT_IN_PARSE, YES_NO_PARSE, JudgeParse

_SCORE = re.compile(
    r"(?P<label>\b(?:score|rating|grade)\b[*_\s]*(?:(?:is|of|[:=])[*_\s]*)?)?"
    r"(?<![\w.,/-])(?<!out of )"          # stands apart on its left
    r"(?P<value>[+-]?\d+(?:\.\d+)?)"
    r"(?P<scale>\s*(?:/|out\s+of)\s*10(?:\.0+)?)?"
    r"(?![\w/%-]|[.,]\d)",                # and on its right ("7." ends a sentence)
    re.ASCII | re.IGNORECASE)
_FIRST_WORD = re.compile(r"\W*(\w+)")

ZERO_TO_TEN_RANGE = (0.0, 10.0)
"""The built-in parse's range before its division by 10."""


def last_score(answer: str) -> float | None:
    """The built-in ``0-10`` parse's score in [0, 1] (module docstring), or None."""
    found = list(_SCORE.finditer(answer))
    marked = [m for m in found if m.group("label") or m.group("scale")]
    if not found:
        return None
    value = float((marked or found)[-1].group("value"))
    return value / 10.0 if _inside(value, *ZERO_TO_TEN_RANGE) else None


def parse_score(answer: str, parse: str | JudgeParse) -> float | None:
    """The score in a judge's answer by ``parse`` (module docstring); None when it does
    not parse, is not finite or lies outside its range."""
    if isinstance(parse, JudgeParse):
        value = _regex_value(answer, parse.regex)
        return value if value is not None and _inside(value, parse.min, parse.max) else None
    if parse == BUILT_IN_PARSE:
        return last_score(answer)
    if parse == YES_NO_PARSE:
        first = _FIRST_WORD.match(answer)
        word = first.group(1).lower() if first else ""
        return {"yes": 1.0, "no": 0.0}.get(word)
    return _regex_value(answer, parse)


def _regex_value(answer: str, regex: str) -> float | None:
    """The first group of ``regex``'s first match as a finite float, or None."""
    found = re.search(regex, answer)
    if found is None or found.group(1) is None:
        return None
    try:
        value = float(found.group(1))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _inside(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high
