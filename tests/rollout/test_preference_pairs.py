"""Preference files are read whole and a bad record is refused in one line naming the
file, the line and the field; the shipped math pairs are what their script writes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rollout.preference_pairs import PreferenceDataError, read_preference_pairs

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}


def write(path: Path, records: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def test_records_are_read_with_their_kind_and_blank_lines_skipped(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "2+2?"}]
    path = write(tmp_path / "p.jsonl", [GOOD, "", {**GOOD, "prompt": messages,
                                                   "kind": "wrong_answer", "id": 7}])
    first, second = read_preference_pairs(path)
    assert (first.prompt, first.chosen, first.rejected, first.kind) == ("2+2?", "4", "5", None)
    assert second.prompt == messages and second.kind == "wrong_answer"
    assert second.where == f"{path} line 3"


@pytest.mark.parametrize(("record", "message"), [
    ({"prompt": "2+2?", "rejected": "5"}, 'line 7: missing "chosen"'),
    ({"chosen": "4", "rejected": "5"}, 'line 7: missing "prompt"'),
    ({"prompt": "2+2?", "chosen": "4"}, 'line 7: missing "rejected"'),
    ({**GOOD, "chosen": 4}, 'line 7: "chosen" must be a string, got int'),
    ({**GOOD, "rejected": None}, 'line 7: "rejected" must be a string, got NoneType'),
    ({**GOOD, "prompt": 3}, 'line 7: "prompt" must be a string or a list of chat messages'),
    ({**GOOD, "prompt": [{"role": "user"}]}, 'line 7: "prompt" message 0 is not'),
    ({**GOOD, "kind": 1}, 'line 7: "kind" must be a string'),
    ("[1, 2]", "line 7: expected a JSON object"),
    ('{"prompt": "2+2?",', "line 7: not valid JSON"),
])
def test_a_bad_record_is_refused_naming_its_line_and_field(tmp_path: Path, record: object,
                                                           message: str) -> None:
    path = write(tmp_path / "pairs.jsonl", [GOOD] * 5 + [""] + [record, GOOD])
    with pytest.raises(PreferenceDataError) as err:
        read_preference_pairs(path)
    assert str(err.value).startswith(f"{path} {message}")
    assert "\n" not in str(err.value)


def test_a_missing_or_empty_file_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(PreferenceDataError, match=r"^data\.train: .*nope\.jsonl: no such file"):
        read_preference_pairs(tmp_path / "nope.jsonl", "data.train")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PreferenceDataError, match=r"data\.test: .* holds no preference pair"):
        read_preference_pairs(tmp_path / "empty.jsonl", "data.test")
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(GOOD).encode() + b"\n\xff\n")
    with pytest.raises(PreferenceDataError, match=r"line 2: not UTF-8 text"):
        read_preference_pairs(tmp_path / "latin1.jsonl")


def test_shipped_math_pairs_are_the_scripts_output(tmp_path: Path) -> None:
    """scripts/make_preference_pairs.py rewrites the committed files byte for byte (its
    seed fixes them); every pair is valid, its chosen side ends in the right number."""
    spec = importlib.util.spec_from_file_location(
        "make_preference_pairs", ROOT / "scripts" / "make_preference_pairs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out-dir", str(tmp_path)])
    for name in ("math-pairs-train.jsonl", "math-pairs-test.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "configs" / "data" / name).read_bytes()
    train = read_preference_pairs(ROOT / "configs" / "data" / "math-pairs-train.jsonl")
    test = read_preference_pairs(ROOT / "configs" / "data" / "math-pairs-test.jsonl")
    assert (len(train), len(test)) == (400, 100)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert {p.kind for p in test} == {"wrong_answer", "wrong_operation", "no_answer", "format"}
    assert all(p.chosen != p.rejected for p in train + test)


def test_shipped_chosen_sides_earn_the_math_reward_and_rejected_ones_do_not() -> None:
    """Scored by the math task's own rules (the number for "as a number" prompts, the
    \\boxed{} content for the others): chosen 1, rejected 0, whatever the kind."""
    from rollout.math_words import make_math_word_problems
    from rollout.rewards import boxed_match, numeric_match

    for split, name, size in (("train", "train", 400), ("heldout", "test", 100)):
        problems = make_math_word_problems((1, 2), size, seed=0, split=split)
        pairs = read_preference_pairs(ROOT / "configs" / "data" / f"math-pairs-{name}.jsonl")
        for problem, pair in zip(problems, pairs, strict=True):
            assert pair.prompt.startswith(problem.text)
            match = boxed_match if "boxed" in pair.prompt else numeric_match
            label = [str(problem.answer)]
            assert match([pair.chosen], label, [{}]) == [1.0], pair
            assert match([pair.rejected], label, [{}]) == [0.0], pair
