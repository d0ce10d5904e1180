"""Built-in environments: the calculator tool and its safety, the number-guessing game."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from rollout.config import FileDatasetConfig, MathWordsDatasetConfig
from rollout.datasets import Prompt, load_prompt_dataset
from rollout.environments.calculator import HINT, Calculator, calculate
from rollout.environments.guess_number import GuessNumber

GUESS_NUMBER_FILE = Path(__file__).parents[2] / "configs/data/guess-number.jsonl"


@pytest.fixture(scope="module")
def math_record() -> dict:
    r = load_prompt_dataset(MathWordsDatasetConfig(num_prompts=1))[0]
    return {"prompt": r.prompt, "label": r.label, "metadata": r.metadata}


def _calculator(record: dict, **kwargs: float) -> tuple[Calculator, str]:
    env = Calculator(**kwargs)
    return env, env.reset(record)


# ---- Calculator ---------------------------------------------------------------------

def test_calculator_reset_shows_problem_and_instructions(math_record: dict) -> None:
    _, first = _calculator(math_record)
    story = math_record["prompt"][0]["content"].split("\n")[0]
    assert story in first
    assert "<calc>" in first and "<result>" in first and "\\boxed{" in first
    assert "step by step" not in first  # math_words' own answer line is replaced


@pytest.mark.parametrize(("expression", "value"), [
    ("12*7", "84"), ("84/7", "12"), ("7/2", "3.5"), ("2+3*4", "14"), ("(2+3)*4", "20"),
    ("-5+2", "-3"), ("-(3-10)", "7"), ("7//2", "3"), ("7%3", "1"), ("2**10", "1024"),
    (" 1.5 * 4 ", "6"), ("1/3", "0.3333333333"), ("12 × 3 ÷ 4", "9"),
])
def test_calculator_computes(math_record: dict, expression: str, value: str) -> None:
    env, _ = _calculator(math_record)
    assert env.step(f"First <calc>{expression}</calc>") == (f"<result>{value}</result>", 0.0,
                                                          False)


def test_calculator_uses_the_last_call(math_record: dict) -> None:
    env, _ = _calculator(math_record)
    assert env.step("<calc>1+1</calc> no, <calc>2+2</calc>")[0] == "<result>4</result>"


@pytest.mark.parametrize("expression", [
    "__import__('os').system('echo pwned')", "os", "x + 1", "(1).__class__", "abs(-3)",
    "9**9**9", "2**100000", "10**99 * 10**99", "1e400", "'a' * 3", "[1, 2]", "True + 1",
    "1 if 1 else 2", "1 < 2", "(-8) ** 0.5", "1 +", "1" * 201, "(" * 100 + "1" + ")" * 100,
    "lambda: 1", "1; 2",
])
def test_calculator_refuses_without_evaluating(expression: str) -> None:
    start = time.monotonic()
    result = calculate(expression)
    assert result.startswith("error: "), result
    assert time.monotonic() - start < 1.0  # nothing huge was computed


def test_calculator_division_by_zero(math_record: dict) -> None:
    env, _ = _calculator(math_record)
    observation, reward, done = env.step("<calc>5/(3-3)</calc>")
    assert observation == "<result>error: division by zero</result>"
    assert (reward, done) == (0.0, False)
    assert calculate("5 % 0") == calculate("0 ** -1") == "error: division by zero"


def test_calculator_answers(math_record: dict) -> None:
    label = math_record["label"]
    env, _ = _calculator(math_record)
    assert env.step(f"So the answer is \\boxed{{{label}}}.") == (None, 1.0, True)
    env, _ = _calculator(math_record)
    assert env.step(f"\\boxed{{{float(label):.1f}}}") == (None, 1.0, True)  # numerically
    env, _ = _calculator(math_record)
    assert env.step(f"\\boxed{{{int(label) + 1}}}") == (None, 0.0, True)
    env, _ = _calculator(math_record, answer_reward=2.0)
    assert env.step(f"\\boxed{{{label}}}")[1] == 2.0


def test_calculator_hint_and_tool_calls(math_record: dict) -> None:
    env, _ = _calculator(math_record, tool_call_reward=-0.1)
    assert env.step("Let me think about it.") == (HINT, 0.0, False)
    assert env.step("<calc>1+") == (HINT, 0.0, False)  # cut off before </calc>
    assert env.tool_calls == 0
    assert env.step("<calc>2*3</calc>") == ("<result>6</result>", -0.1, False)
    assert env.step("<calc>nope</calc>")[0].startswith("<result>error: ")
    assert env.tool_calls == 2
    # A positive reward is paid once, for the first call that computes a value.
    env, _ = _calculator(math_record, tool_call_reward=0.2)
    assert env.step("<calc>1/0</calc>")[1:] == (0.0, False)
    assert env.step("<calc>2*3</calc>") == ("<result>6</result>", 0.2, False)
    assert env.step("<calc>2*4</calc>") == ("<result>8</result>", 0.0, False)


def test_calculator_needs_a_label() -> None:
    with pytest.raises(ValueError, match="label"):
        Calculator().reset({"prompt": "What is 2+2?", "label": None, "metadata": {}})


# ---- GuessNumber --------------------------------------------------------------------

def _guess_game(label: str | None, prompt: Prompt = "Guess the secret number.",
                **kwargs: int) -> tuple[GuessNumber, str]:
    env = GuessNumber(**kwargs)
    return env, env.reset({"prompt": prompt, "label": label, "metadata": {}})


def test_guess_number_secret_from_label() -> None:
    env, first = _guess_game("11")
    assert "between 1 and 16" in first
    assert env.step("10") == ("Your guess 10 is too low. The secret number is higher.", 0.0,
                              False)
    assert env.step("I guess 12") == ("Your guess 12 is too high. The secret number is "
                                      "lower.", 0.0, False)
    assert env.step("Maybe 3, no: 11") == (None, 1.0, True)


def test_guess_number_secret_from_prompt_hash() -> None:
    def secret(prompt: Prompt, label: str | None = None, **kwargs: int) -> int:
        env, _ = _guess_game(label, prompt, **kwargs)
        return next(g for g in range(-100, 100) if env.step(str(g))[2])

    prompts = [f"Round {i}" for i in range(40)]
    secrets = [secret(p) for p in prompts]
    assert secrets == [secret(p) for p in prompts]  # deterministic
    assert all(1 <= s <= 16 for s in secrets) and len(set(secrets)) > 4
    assert secret("Round 3", label="99") == secrets[3]  # out of range: the hash decides
    assert secret("Round 3", label="n/a") == secrets[3]
    chat = [{"role": "user", "content": "guess"}]
    assert secret(chat) == secret(list(chat)) and -3 <= secret(chat, low=-3, high=3) <= 3


def test_guess_number_hint_on_garbage() -> None:
    env, _ = _guess_game("5", low=2, high=9)
    assert env.step("hmm, no idea") == ("Answer with a single whole number between 2 and 9.",
                                        0.0, False)
    assert env.step("5") == (None, 1.0, True)


@pytest.mark.parametrize("secret", range(1, 17))
def test_guess_number_binary_search_wins(secret: int) -> None:
    env, _ = _guess_game(str(secret))
    low, high = 1, 16
    max_turns = math.ceil(math.log2(16)) + 1
    for _ in range(max_turns):
        guess = (low + high) // 2
        observation, reward, done = env.step(f"My guess: {guess}")
        if done:
            assert (observation, reward, guess) == (None, 1.0, secret)
            return
        assert observation is not None
        if "too low" in observation:
            low = guess + 1
        else:
            assert "too high" in observation
            high = guess - 1
    pytest.fail(f"no win in {max_turns} turns")


def test_guess_number_dataset_loads() -> None:
    records = load_prompt_dataset(FileDatasetConfig(type="jsonl", path=str(GUESS_NUMBER_FILE)))
    assert len(records) >= 100
    assert len({r.prompt for r in records}) == len(records)  # distinct: splits by hash work
    labels = [int(r.label) for r in records if r.label is not None]
    assert len(labels) == len(records) and set(labels) == set(range(1, 17))
    env, _ = _guess_game(records[0].label, records[0].prompt)
    assert env.step(records[0].label or "") == (None, 1.0, True)
