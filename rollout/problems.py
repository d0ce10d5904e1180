"""``Problem(field, message)``: one thing wrong with an input, the one shape of "field:
message" from the config rules to a 422 answer.

A config rule raises ``field.path: message`` inside its section (:meth:`Problem.from_rule`
names the field from the job's root); the preflight, the controller's submission checks
and a session's call checks build Problems directly; every HTTP answer that lists them
has the body of :func:`problems_body`. Standard library only: rollout/, trainer/ and
services/ all import it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RULE_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): (.+)$", re.DOTALL)
"""How every rule names its field: ``field.path: message``."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input."""

    field: str
    """Full dotted path of the field at fault (``aggregation.divisor``, ``data[3].tokens``);
    "" when it is the whole input (YAML syntax with its line and column, not a mapping)."""
    message: str
    """What is wrong, without the field."""

    @classmethod
    def from_rule(cls, text: str, section: str = "") -> Problem:
        """A rule's ``field.path: message`` raised inside ``section`` (a dotted path, ""
        for the job); a text naming no field is about the section itself."""
        named = RULE_FIELD.match(text)
        if not named:
            return cls(section, text)
        return cls(f"{section}.{named[1]}" if section else named[1], named[2])

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


def problems_detail(problems: Sequence[Problem]) -> str:
    """The problems on one line: ``a: x; b.c: y``."""
    return "; ".join(str(p) for p in problems)


def problems_body(problems: Sequence[Problem], detail: str | None = None) -> dict[str, Any]:
    """The JSON body of an answer that refuses an input: ``{"detail", "errors": [{"field",
    "message"}]}``; ``detail`` defaults to :func:`problems_detail`."""
    return {"detail": problems_detail(problems) if detail is None else detail,
            "errors": [{"field": p.field, "message": p.message} for p in problems]}
