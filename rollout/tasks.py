"""Built-in synthetic tasks: verifiable, download-free, and short enough for the tiny model.

Every prompt ends with ``=`` and the answer follows it, then EOS. Answers differ in
length within and across tasks, so the loss aggregation modes really differ.

    task     prompt             answer   difficulty d controls
    copy     "cp abc="          "abc"    string length 1 … d+2          (the easiest)
    repeat   "rep a 3="         "aaa"    repeat count 1 … 2d+2
    reverse  "rev abc="         "cba"    string length 2 … d+2
    add      "add 12 7="        "19"     operands of up to d digits
    count    "cnt a abacb="     "2"      string length d+2 … 2d+4 over 'abc'

Examples are a pure function of (task, difficulty, seed): the same seed gives the same
stream on every machine (Python's ``random.Random`` with an integer seed is portable).
"""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import get_args

from rollout.config import TaskName

TASK_NAMES: tuple[str, ...] = get_args(TaskName)
_LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class TaskExample:
    """One verifiable prompt and its reference answer."""

    prompt: str
    answer: str


def _word(rng: random.Random, length: int, alphabet: str = _LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(length))


def _copy(rng: random.Random, d: int) -> TaskExample:
    word = _word(rng, rng.randint(1, d + 2))
    return TaskExample(f"cp {word}=", word)


def _repeat(rng: random.Random, d: int) -> TaskExample:
    char, times = rng.choice(_LETTERS), rng.randint(1, 2 * d + 2)
    return TaskExample(f"rep {char} {times}=", char * times)


def _reverse(rng: random.Random, d: int) -> TaskExample:
    word = _word(rng, rng.randint(2, d + 2))
    return TaskExample(f"rev {word}=", word[::-1])


def _add(rng: random.Random, d: int) -> TaskExample:
    a, b = rng.randrange(10**d), rng.randrange(10**d)
    return TaskExample(f"add {a} {b}=", str(a + b))


def _count(rng: random.Random, d: int) -> TaskExample:
    word, char = _word(rng, rng.randint(d + 2, 2 * d + 4), "abc"), rng.choice("abc")
    return TaskExample(f"cnt {char} {word}=", str(word.count(char)))


_GENERATORS: dict[str, Callable[[random.Random, int], TaskExample]] = {
    "copy": _copy,
    "repeat": _repeat,
    "reverse": _reverse,
    "add": _add,
    "count": _count,
}


def iter_task_examples(task: str, difficulty: int = 1, seed: int = 0) -> Iterator[TaskExample]:
    """An endless, deterministic stream of examples of one task (e.g. for warmup SFT)."""
    if task not in _GENERATORS:
        raise ValueError(f"task: unknown task {task!r}; choose one of {', '.join(TASK_NAMES)}")
    if difficulty < 1:
        raise ValueError(f"difficulty: must be >= 1, got {difficulty}")
    generate = _GENERATORS[task]
    rng = random.Random(seed)
    while True:
        yield generate(rng, difficulty)


def make_task_examples(task: str, difficulty: int, seed: int, num: int) -> list[TaskExample]:
    """The first `num` examples of :func:`iter_task_examples`."""
    return list(itertools.islice(iter_task_examples(task, difficulty, seed), num))
