"""Built-in synthetic tasks: correct answers, deterministic streams, a difficulty knob."""

from __future__ import annotations

import pytest

from rollout.tasks import TASK_NAMES, iter_task_examples, make_task_examples


def _solve(prompt: str) -> str:
    """An independent solver of the prompt formats documented in rollout/tasks.py."""
    name, *args = prompt.removesuffix("=").split(" ")
    if name == "cp":
        return args[0]
    if name == "rep":
        return args[0] * int(args[1])
    if name == "rev":
        return args[0][::-1]
    if name == "add":
        return str(int(args[0]) + int(args[1]))
    assert name == "cnt"
    return str(args[1].count(args[0]))


@pytest.mark.parametrize("task", TASK_NAMES)
def test_answers_are_correct_and_streams_deterministic(task: str) -> None:
    examples = make_task_examples(task, difficulty=3, seed=7, num=200)
    assert examples == make_task_examples(task, difficulty=3, seed=7, num=200)
    assert examples != make_task_examples(task, difficulty=3, seed=8, num=200)
    for example in examples:
        assert example.prompt.endswith("=") and len(example.prompt) <= 24
        assert _solve(example.prompt) == example.answer


def test_answers_vary_in_length_and_difficulty_lengthens_them() -> None:
    for task in ("copy", "repeat", "reverse", "add"):
        easy = [len(e.answer) for e in make_task_examples(task, 1, 0, 300)]
        hard = [len(e.answer) for e in make_task_examples(task, 5, 0, 300)]
        assert len(set(easy)) > 1, task
        assert sum(hard) > sum(easy), task


def test_unknown_task_and_bad_difficulty() -> None:
    with pytest.raises(ValueError, match="task: unknown task 'sort'; choose one of copy"):
        next(iter_task_examples("sort"))
    with pytest.raises(ValueError, match="difficulty: must be >= 1"):
        next(iter_task_examples("copy", difficulty=0))
