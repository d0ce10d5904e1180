"""Math word problems: deterministic, split-disjoint, correctly solved, configurable, scored."""

from __future__ import annotations

import random
import re

import pytest
from pydantic import ValidationError

from rollout.config import MathWordsDatasetConfig, RewardConfig, RolloutConfig
from rollout.datasets import load_prompt_dataset
from rollout.math_words import (
    LEVELS,
    MathWordProblem,
    generate_problem,
    make_math_word_problems,
    math_word_prompt,
    solve,
)
from rollout.rewards import RewardScorer
from rollout.splits import split_of
from services.config.job import ConfigError, parse_job_config


def _texts(problems: list[MathWordProblem]) -> list[str]:
    return [p.text for p in problems]


def test_same_seed_same_problems_other_seed_others() -> None:
    first = make_math_word_problems([1, 2, 3, 4], 40, seed=5)
    assert _texts(first) == _texts(make_math_word_problems([1, 2, 3, 4], 40, seed=5))
    assert set(_texts(first)).isdisjoint(_texts(make_math_word_problems([1, 2, 3, 4], 40, 6)))


def test_pinned_problem() -> None:
    # Golden value: the generator must not drift silently (it would move problems across
    # the split and change every seeded run).
    easy = make_math_word_problems([1], 1, seed=0)[0]
    assert (easy.text, easy.answer) == (
        "Kenji has 3 cards. The next day, Kenji gives 2 cards to Kofi. "
        "How many cards does Kenji have at the end?", 1)
    hard = make_math_word_problems([3], 1, seed=0)[0]
    assert (hard.text, hard.answer) == (
        "At first, Anna has 32 crayons. After that, Anna collects another 15 crayons. "
        "Next, Anna buys enough crayons to have 3 times as many as before. After that, "
        "Anna collects another 36 crayons. How many crayons does Anna have at the end?", 177)


def test_splits_are_disjoint_and_held_out_share_is_about_a_fifth() -> None:
    train = make_math_word_problems([1, 2, 3], 300, seed=0, split="train")
    heldout = make_math_word_problems([1, 2, 3], 300, seed=0, split="heldout")
    assert len(set(_texts(train))) == len(set(_texts(heldout))) == 300  # distinct prompts
    assert set(_texts(train)).isdisjoint(_texts(heldout))
    assert all(split_of(t) == "heldout" for t in _texts(heldout))
    rng = random.Random(1)
    drawn = [generate_problem(rng, 2).text for _ in range(2000)]
    assert 0.16 < sum(split_of(t) == "heldout" for t in drawn) / len(drawn) < 0.24


def _checked_answer(problem: MathWordProblem) -> int:
    """Solve again from the text's numbers, checking every intermediate count."""
    numbers = [int(n) for n in re.findall(r"\d+", problem.text)]
    assert numbers == [problem.start, *(k for _, k in problem.steps)], problem.text
    value = problem.start
    for op, k in problem.steps:
        assert value >= 1 and k >= 2
        if op == "/":
            assert value % k == 0, problem.text
        value = {"+": value + k, "-": value - k, "*": value * k, "/": value // k}[op]
    return value


def test_answers_are_correct_positive_integers_and_levels_add_steps() -> None:
    for difficulty, level in LEVELS.items():
        problems = make_math_word_problems([difficulty], 100, seed=difficulty)
        for p in problems:
            assert p.difficulty == difficulty and len(p.steps) == difficulty
            assert _checked_answer(p) == p.answer >= 1 and p.answer <= level.cap
        ops = {op for p in problems for op, _ in p.steps}
        assert ops == ({"+", "-"} if difficulty <= 2 else {"+", "-", "*", "/"})
        if difficulty >= 3:
            assert all(any(op in "*/" for op, _ in p.steps) for p in problems)


def test_hand_made_examples() -> None:
    assert solve(3, [("+", 5)]) == 8
    assert solve(4, [("*", 6), ("-", 4), ("/", 5)]) == 4
    with pytest.raises(ValueError, match="not an integer"):
        solve(7, [("/", 2)])


def test_variety() -> None:
    problems = make_math_word_problems([1, 2], 200, seed=0)
    first_words = {p.text.split()[0] for p in problems}
    objects = {re.search(r"How many ([a-z ]+) do", p.text)[1] for p in problems}
    assert len(first_words) >= 20 and len(objects) >= 15


def test_records_mix_levels_evenly_and_ask_for_the_format() -> None:
    records = load_prompt_dataset(MathWordsDatasetConfig(difficulties=[1, 3], num_prompts=10))
    assert [r.metadata for r in records[:2]] == [{"task": "math_words", "difficulty": 1},
                                                 {"task": "math_words", "difficulty": 3}]
    assert sum(r.metadata["difficulty"] == 3 for r in records) == 5
    (message,) = records[0].prompt
    assert message["role"] == "user" and message["content"].endswith("in \\boxed{}.")
    assert records[0].label is not None and records[0].label.isdigit()
    problem = make_math_word_problems([1], 1, seed=0)[0]
    assert math_word_prompt(problem, "last_number").endswith(
        "\nReply with the answer only, as a number.")


def test_config_rejects_bad_fields_by_name() -> None:
    for bad, field in [({"difficulties": [5]}, "difficulties.0"),
                       ({"difficulties": []}, "difficulties"),
                       ({"num_prompts": 0}, "num_prompts"),
                       ({"split": "test"}, "split"),
                       ({"answer_format": "latex"}, "answer_format"),
                       ({"task": "add"}, "task")]:
        with pytest.raises(ValidationError, match=re.escape(f"dataset.math_words.{field}")):
            RolloutConfig.model_validate({"dataset": {"type": "math_words", **bad}})
    with pytest.raises(ValidationError, match="difficulties: each level at most once"):
        MathWordsDatasetConfig(difficulties=[2, 2])


def test_job_config_yaml() -> None:
    config = parse_job_config(
        "rollout:\n"
        "  dataset: {type: math_words, split: heldout, difficulties: [2, 4], num_prompts: 64,\n"
        "            seed: 3, answer_format: last_number}\n"
        "  reward: {type: numeric}\n")
    assert config.rollout.dataset == MathWordsDatasetConfig(
        split="heldout", difficulties=[2, 4], num_prompts=64, seed=3,
        answer_format="last_number")
    with pytest.raises(ConfigError, match=r"rollout\.dataset\.difficulties\[0\]: Input should "
                                          r"be less than or equal to 4"):
        parse_job_config("rollout: {dataset: {type: math_words, difficulties: [5]}}\n")
    with pytest.raises(ConfigError, match=r"warmup\.enabled: the warm-up trains on the synthetic"):
        parse_job_config("warmup: {enabled: true}\nrollout: {dataset: {type: math_words}}\n")


@pytest.mark.parametrize("reward", ["boxed", "numeric"])
def test_rewards_score_correct_answers_one(reward: str) -> None:
    record = load_prompt_dataset(MathWordsDatasetConfig(num_prompts=1))[0]
    assert record.label is not None
    right, wrong = int(record.label), int(record.label) + 1
    responses = [f"We add and subtract step by step, so the answer is \\boxed{{{right}}}.",
                 f"So the answer is \\boxed{{{wrong}}}.", f"The answer is {right}."]
    scores = RewardScorer(RewardConfig(type=reward)).score(
        responses, [record.label] * 3, [record.metadata] * 3).rewards
    assert scores == ([1.0, 0.0, 0.0] if reward == "boxed" else [1.0, 0.0, 1.0])
