"""A judge's answer read as a score (rollout/judge_parse.py): the built-in ``0-10``
parse's table of answers, the range checks of ``{regex, min, max}``, and the config's
refusals naming the field."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from rollout.judge_parse import parse_score
from rollout.reward_config import JudgeConfig, JudgeParse

ZERO_TO_TEN: list[tuple[str, float | None]] = [
    ("7", 0.7),
    ("7.", 0.7),
    ("I give it a 7.", 0.7),
    ("The score is 8.", 0.8),
    ("8/10", 0.8),
    ("8 / 10", 0.8),
    ("10/10", 1.0),
    ("Score: 9", 0.9),
    ("score:9", 0.9),
    ("**Score: 6**", 0.6),
    ("On a scale of 0 to 10, this is a 9", 0.9),
    ("On a scale of 0 to 10, I'd say 3 out of 10.", 0.3),
    ("Question 4 asks for 12 apples; the answer is right. Rating: 10", 1.0),
    ("0", 0.0),
    ("Score: 0.", 0.0),
    ("7.5", 0.75),
    ("I'd rate it 9.5/10.", 0.95),
    ("-3", None),  # out of range: unparsed
    ("42 is wrong", None),
    ("Score: 11", None),
    ("10.5", None),
    ("no idea", None),
    ("", None),
    ("version 1.2.3", None),  # no number stands alone
    ("It scores 70%", None),
    ("8/100", None),
    ("7th place", None),
    ("1,000 reasons", None),
    ("I'd give it a 5, maybe 6.", 0.6),
    ("Score: 4\n", 0.4),
    # a marked score (a label or /10) outranks a later bare number
    ("Score: 7. There were 3 mistakes in 2 steps.", 0.7),
    ("8/10 - though 2 steps are terse", 0.8),
    ("Rating: 6\nThe answer cites 4 facts.", 0.6),
    ("The final score is **9**; 1 typo.", 0.9),
    ("Grade = 5 (out of 10)", 0.5),
]


@pytest.mark.parametrize(("answer", "expected"), ZERO_TO_TEN)
def test_built_in_parse_takes_the_last_number_standing_as_a_score(
        answer: str, expected: float | None) -> None:
    got = parse_score(answer, "0-10")
    if expected is None:
        assert got is None
    else:
        assert got is not None and got == pytest.approx(expected, abs=1e-12)


def test_the_table_is_long_and_the_parse_stays_in_zero_one() -> None:
    assert len(ZERO_TO_TEN) >= 20
    parsed = [parse_score(a, "0-10") for a, _ in ZERO_TO_TEN]
    assert all(v is None or 0.0 <= v <= 1.0 for v in parsed)


def test_regex_string_scores_must_be_finite() -> None:
    regex = r"Verdict: (\S+)"
    assert parse_score("Verdict: 0.25", regex) == 0.25
    assert parse_score("Verdict: 85", regex) == 85.0  # no range declared in the string form
    for answer in ("Verdict: nan", "Verdict: inf", "Verdict: -inf", "Verdict: none"):
        assert parse_score(answer, regex) is None, answer


def test_regex_with_a_range_refuses_what_lies_outside() -> None:
    parse = JudgeParse(regex=r"Verdict: (\S+)", min=1.0, max=5.0)
    assert parse_score("Verdict: 1", parse) == 1.0
    assert parse_score("Verdict: 5", parse) == 5.0
    assert parse_score("Verdict: 3.5", parse) == 3.5
    for answer in ("Verdict: 0.99", "Verdict: 85", "Verdict: nan", "Verdict: inf",
                   "Verdict: ?"):
        assert parse_score(answer, parse) is None, answer


def test_config_takes_a_string_or_regex_min_max() -> None:
    assert JudgeConfig().parse == "0-10"
    assert JudgeConfig(parse="yes-no").parse == "yes-no"
    config = JudgeConfig.model_validate({"parse": {"regex": "S: ([0-9.]+)", "min": 0,
                                                   "max": 100}})
    assert isinstance(config.parse, JudgeParse)
    assert parse_score("S: 85", config.parse) == 85.0
    assert parse_score("S: 185", config.parse) is None


@pytest.mark.parametrize(("parse", "field"), [
    ({"regex": "S: [0-9]+", "min": 0, "max": 1}, "parse.regex"),
    ({"regex": "S: ([0-9]+", "min": 0, "max": 1}, "parse.regex"),
    ({"regex": "S: ([0-9]+)", "min": 1, "max": 1}, "parse.max"),
    ({"regex": "S: ([0-9]+)", "min": 0, "max": math.inf}, "max"),
    ("S: [0-9]+", "parse"),
])
def test_config_refusals_name_the_field(parse: object, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        JudgeConfig.model_validate({"parse": parse})
