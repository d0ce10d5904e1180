r"""Write the shipped math preference pairs (configs/data/math-pairs-{train,test}.jsonl)
from the built-in math word problems (rollout/math_words.py), offline and deterministic.

    python scripts/make_preference_pairs.py                  # the committed files
    python scripts/make_preference_pairs.py --out-dir /tmp/x --num-train 1000 --seed 1

Prompts are those of ``configs/smollm2-math.yaml``'s dataset (levels 1-2), asking for
the answer as a number or in \boxed{} in turn. The chosen response gives the right
number in the asked format (the number alone, a sentence, or the worked steps, ending in
it); the rejected one is, by ``kind``, in the same style where the kind allows:

    wrong_answer     the same style with a wrong final number (an arithmetic slip)
    wrong_operation  worked steps that apply an operation the story does not (+ for −)
    no_answer        no number at all
    format           the right number, dispreferred: \boxed{} asked and not used, or a
                     number after the answer (which the numeric reward would read)

Train problems come from the dataset's train split and held-out ones from its held-out
split (rollout/splits.py), so the two files never share a problem.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rollout.math_words import MathWordProblem, make_math_word_problems, math_word_prompt

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (1, 2)
KINDS = (("wrong_answer", 0.35), ("wrong_operation", 0.2), ("no_answer", 0.2),
         ("format", 0.25))
FLIP = {"+": "-", "-": "+", "*": "/", "/": "*"}
NO_ANSWER = ("I'm not sure how to solve this.", "Let me think about this step by step.",
             "It depends on how many {obj} there were.", "I cannot tell from the story.",
             "That is a tricky question about {obj}.")


def _objects(problem: MathWordProblem) -> str:
    words = problem.text.split("How many ")[-1]
    return words.split(" do")[0]


def _chain(start: int, steps: tuple[tuple[str, int], ...]) -> tuple[str, int]:
    """Worked steps ``3 + 5 = 8. 8 - 2 = 6.`` and the value they reach (None-free: a
    division that is not exact rounds down, as a wrong operation may)."""
    value, parts = start, []
    for op, k in steps:
        new = {"+": value + k, "-": value - k, "*": value * k, "/": value // k}[op]
        parts.append(f"{value} {op} {k} = {new}.")
        value = new
    return " ".join(parts), value


def _chosen(problem: MathWordProblem, boxed: bool, style: int) -> str:
    answer, worked = problem.answer, _chain(problem.start, problem.steps)[0]
    if boxed:
        return f"{worked} \\boxed{{{answer}}}" if style else f"\\boxed{{{answer}}}"
    return (str(answer), f"The answer is {answer}.", f"{worked} The answer is {answer}.")[style]


def _wrong_number(rng: random.Random, answer: int) -> int:
    while (wrong := answer + rng.choice([-1, 1]) * rng.randint(1, 10)) < 0 or wrong == answer:
        pass
    return wrong


def _rejected(rng: random.Random, problem: MathWordProblem, boxed: bool, style: int,
              kind: str) -> str:
    answer, (worked, _) = problem.answer, _chain(problem.start, problem.steps)
    if kind == "no_answer":
        return rng.choice(NO_ANSWER).format(obj=_objects(problem))
    if kind == "format":
        if boxed:
            return f"{worked} The answer is {answer}." if style else f"The answer is {answer}."
        question = rng.choice([n for n in range(2, 10) if n != answer])
        return f"The answer is {answer}. I hope this helps with question {question}."
    if kind == "wrong_operation":
        i = rng.randrange(len(problem.steps))
        steps = list(problem.steps)
        steps[i] = (FLIP[steps[i][0]], steps[i][1])
        worked, wrong = _chain(problem.start, tuple(steps))
        if wrong == answer:  # + k then − k elsewhere can land on the answer: a slip then
            kind = "wrong_answer"
        else:
            return f"{worked} \\boxed{{{wrong}}}" if boxed else f"{worked} The answer is {wrong}."
    wrong = _wrong_number(rng, answer)
    *before, last = worked.split(" ")
    slipped = " ".join([*before, f"{wrong}."]) if last == f"{answer}." else worked
    if boxed:
        return f"{slipped} \\boxed{{{wrong}}}" if style else f"\\boxed{{{wrong}}}"
    return (str(wrong), f"The answer is {wrong}.", f"{slipped} The answer is {wrong}.")[style]


def make_pairs(num_pairs: int, seed: int, split: str) -> list[dict[str, str]]:
    """``num_pairs`` records of ``split`` ("train" or "heldout"), a pure function of the
    arguments."""
    rng = random.Random(seed)
    problems = make_math_word_problems(LEVELS, num_pairs, seed=seed, split=split)
    kinds = [name for name, share in KINDS for _ in range(round(share * num_pairs))]
    kinds = (kinds + [KINDS[0][0]] * num_pairs)[:num_pairs]  # each kind its share, exactly
    rng.shuffle(kinds)
    records = []
    for i, (problem, kind) in enumerate(zip(problems, kinds, strict=True)):
        boxed = i % 2 == 1
        style = rng.randrange(2 if boxed else 3)
        if kind == "wrong_operation":  # both sides show their steps: no style to go by
            style = 1 if boxed else 2
        elif kind == "format" and not boxed:  # both say "The answer is …": only the tail differs
            style = 1
        records.append({
            "prompt": math_word_prompt(problem, "boxed" if boxed else "last_number"),
            "chosen": _chosen(problem, boxed, style),
            "rejected": _rejected(rng, problem, boxed, style, kind),
            "kind": kind,
        })
    return records


def write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "configs" / "data")
    parser.add_argument("--num-train", type=int, default=400)
    parser.add_argument("--num-test", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_jsonl(args.out_dir / "math-pairs-train.jsonl",
                make_pairs(args.num_train, args.seed, "train"))
    write_jsonl(args.out_dir / "math-pairs-test.jsonl",
                make_pairs(args.num_test, args.seed, "heldout"))


if __name__ == "__main__":
    main()
