r"""Math word problems: GSM8K-style arithmetic stories, generated on the fly (no download).

A story follows one running count — how many of some object its current holder has —
through ``difficulty`` operations and asks for the final count:

    level  operations                          numbers
    1      one + or −                          start 2…20, operands 2…10
    2      two of + / −                        start 2…50, operands 2…30
    3      three, one of them × or ÷           start 2…40, operands 2…40, factors 2…5
    4      four, one or two of them × or ÷     start 20…300, operands 10…200, factors 2…9

    "Tom has 3 apples. Then Tom buys 5 more apples. How many apples does Tom have now?"

Each problem keeps its structured form (``start`` and ``steps``, one ``(op, operand)`` per
operation), from which the answer is computed. Every number in the text is written in
digits, in the order of the solution — start, then each operand — and no other digit
appears, so the text and the structure can be checked against each other. Counts stay
≥ 1 after every step and divisions are exact: answers are positive integers.

Problems are a pure function of (difficulty, seed): ``random.Random`` with an integer seed
gives the same stream on every machine. A problem's split is the hash of its text
(rollout/splits.py), so train and held-out never share a problem, whatever the seeds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from rollout.config import AnswerFormat, DatasetSplit
from rollout.splits import split_of

NAMES = ("Tom", "Anna", "Liam", "Mia", "Noah", "Emma", "Omar", "Sofia", "Ravi", "Chen",
         "Lucas", "Ava", "Ben", "Zoe", "Kenji", "Lena", "Mateo", "Ines", "Ahmed", "Grace",
         "Yuki", "Pablo", "Nora", "Sam", "Priya", "Jonas", "Elif", "Kofi", "Maya", "Leo")
OBJECTS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "stamps", "shells",
           "cards", "crayons", "beads", "toy cars", "oranges", "balloons", "buttons", "candles",
           "cupcakes", "erasers", "feathers", "pebbles")
CONTAINERS = (("bag", "bags"), ("box", "boxes"), ("jar", "jars"), ("pack", "packs"),
              ("basket", "baskets"), ("tin", "tins"))

# Fields: {a} the holder, {b} someone not yet in the story, {n} the start, {k} the operand,
# {obj} the objects (plural), {box} / {boxes} a container.
_START = ("{a} has {n} {obj}.", "{a} starts with {n} {obj}.", "At first, {a} has {n} {obj}.",
          "{a} owns {n} {obj}.")
_START_TIMES = ("{a} has {n} {boxes} with {k} {obj} in each {box}.",
                "{a} buys {n} {boxes} of {obj}, and each {box} holds {k}.")
_SENTENCES = {
    "+": ("{a} buys {k} more {obj}.", "{b} gives {a} {k} more {obj}.",
          "{a} finds {k} more {obj}.", "{a} gets {k} {obj} as a present.",
          "{a} collects another {k} {obj}."),
    "-": ("{a} gives {k} {obj} to {b}.", "{a} loses {k} {obj}.", "{a} sells {k} {obj}.",
          "{a} gives away {k} {obj}.", "{b} takes {k} {obj} from {a}."),
    "*": ("{a} buys enough {obj} to have {k} times as many as before.",),
    "/": ("{a} puts the {obj} into {k} equal piles and keeps only one pile.",
          "{a} splits the {obj} equally into {k} {boxes} and gives away all but one {box}."),
}
_HAND_OVER = "{b} has {k} times as many {obj} as {a}."
"""A × step that moves the story to a new holder, {b}."""
_CONNECTORS = ("Then ", "After that, ", "Later, ", "Next, ", "The next day, ", "")
_QUESTIONS = ("How many {obj} does {a} have now?", "How many {obj} does {a} have at the end?",
              "How many {obj} does {a} end up with?")
ANSWER_INSTRUCTIONS: dict[str, str] = {
    "boxed": "Solve the problem step by step, then put the final answer in \\boxed{}.",
    # Short on purpose: a 135 M model asked to reason first rarely reaches an answer
    # within a CPU-sized budget (measured on SmolLM2-135M: 10-12 % greedy vs 27 % so).
    "last_number": "Reply with the answer only, as a number.",
}


@dataclass(frozen=True)
class _Level:
    start: tuple[int, int]
    operand: tuple[int, int]
    """Range of a + or − operand."""
    factor: tuple[int, int]
    """Range of a × or ÷ operand (and of the container count of a story that starts with ×)."""
    per_container: tuple[int, int]
    num_scaling: tuple[int, int]
    """How many of the steps are × or ÷."""
    cap: int
    """Largest count a story may reach."""


LEVELS = {
    1: _Level((2, 20), (2, 10), (2, 2), (2, 2), (0, 0), 40),
    2: _Level((2, 50), (2, 30), (2, 2), (2, 2), (0, 0), 120),
    3: _Level((2, 40), (2, 40), (2, 5), (2, 12), (1, 1), 500),
    4: _Level((20, 300), (10, 200), (2, 9), (5, 30), (1, 2), 5000),
}
"""Difficulty level → its numbers; the level is also the number of steps."""

Step = tuple[str, int]


@dataclass(frozen=True)
class MathWordProblem:
    """One story, and the arithmetic it encodes."""

    text: str
    start: int
    steps: tuple[Step, ...]
    """One ``(op, operand)`` per operation, op in ``+ - * /``, applied in order to start."""
    difficulty: int

    @property
    def answer(self) -> int:
        return solve(self.start, self.steps)


def solve(start: int, steps: Sequence[Step]) -> int:
    """Apply the steps in order; a division must be exact."""
    value = start
    for op, k in steps:
        if op == "/":
            if value % k:
                raise ValueError(f"{value} / {k} is not an integer")
            value //= k
        else:
            value = {"+": value + k, "-": value - k, "*": value * k}[op]
    return value


def _shift(rng: random.Random, x: int, level: _Level) -> Step | None:
    lo, hi = level.operand
    can_subtract, can_add = x - 1 >= lo, x + lo <= level.cap
    if can_subtract and (not can_add or rng.random() < 0.5):
        return "-", rng.randint(lo, min(hi, x - 1))
    if can_add:
        return "+", rng.randint(lo, min(hi, level.cap - x))
    return None


def _scale(rng: random.Random, x: int, level: _Level) -> Step | None:
    lo, hi = level.factor
    options = [("/", k) for k in range(lo, hi + 1) if x % k == 0 and x // k >= 2]
    options += [("*", k) for k in range(lo, hi + 1) if x * k <= level.cap]
    if not options:
        return None
    ops = sorted({op for op, _ in options})  # × and ÷ equally likely, whatever their counts
    op = rng.choice(ops)
    return rng.choice([s for s in options if s[0] == op])


def _story(rng: random.Random, difficulty: int) -> MathWordProblem | None:
    """One attempt; None when the drawn numbers leave no valid next step."""
    level = LEVELS[difficulty]
    num_scaling = rng.randint(*level.num_scaling)
    scaling = set(rng.sample(range(difficulty), num_scaling))
    holder, *others = rng.sample(NAMES, difficulty + 1)
    box, boxes = rng.choice(CONTAINERS)
    words = {"obj": rng.choice(OBJECTS), "box": box, "boxes": boxes}
    steps: list[Step] = []
    if 0 in scaling and rng.random() < 0.5:  # the story starts with a multiplication
        start, k = rng.randint(*level.factor), rng.randint(*level.per_container)
        sentences = [rng.choice(_START_TIMES).format(a=holder, n=start, k=k, **words)]
        steps.append(("*", k))
    else:
        start = rng.randint(*level.start)
        sentences = [rng.choice(_START).format(a=holder, n=start, **words)]
    value, connector = solve(start, steps), ""
    for i in range(len(steps), difficulty):
        step = (_scale if i in scaling else _shift)(rng, value, level)
        if step is None:
            return None
        op, k = step
        other = others[i]
        template = rng.choice(_SENTENCES[op])
        if op == "*" and rng.random() < 0.5:
            template = _HAND_OVER
        sentence = template.format(a=holder, b=other, k=k, **words)
        connector = rng.choice([c for c in _CONNECTORS if c != connector or not c])
        sentences.append(connector + sentence)
        if template is _HAND_OVER:
            holder = other
        steps.append(step)
        value = solve(value, [step])
    sentences.append(rng.choice(_QUESTIONS).format(a=holder, **words))
    return MathWordProblem(" ".join(sentences), start, tuple(steps), difficulty)


def generate_problem(rng: random.Random, difficulty: int) -> MathWordProblem:
    """The next problem of this level from ``rng`` (attempts that dead-end are redrawn)."""
    if difficulty not in LEVELS:
        raise ValueError(f"difficulty: must be one of {sorted(LEVELS)}, got {difficulty}")
    while (problem := _story(rng, difficulty)) is None:
        pass
    return problem


def make_math_word_problems(difficulties: Sequence[int], num_problems: int, seed: int,
                            split: DatasetSplit = "train") -> list[MathWordProblem]:
    """``num_problems`` distinct problems of ``split``, the levels taking turns (evenly mixed).

    Problems of the other split are drawn and dropped, so the train stream and the
    held-out stream of one seed differ, but neither ever contains the other's problems.
    """
    if not difficulties:
        raise ValueError("difficulties: needs at least one level")
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[MathWordProblem] = []
    for i in range(num_problems):
        difficulty = difficulties[i % len(difficulties)]
        for _ in range(10_000):  # a level has far more stories than any num_prompts allowed
            problem = generate_problem(rng, difficulty)
            if problem.text not in seen and split_of(problem.text) == split:
                break
        else:
            raise ValueError(f"num_prompts: found only {i} distinct problems for levels "
                             f"{list(difficulties)}")
        seen.add(problem.text)
        problems.append(problem)
    return problems


def math_word_prompt(problem: MathWordProblem, answer_format: AnswerFormat = "boxed") -> str:
    r"""The user message: the story, then how to give the answer (``\boxed{}`` or a number)."""
    return f"{problem.text}\n{ANSWER_INSTRUCTIONS[answer_format]}"
