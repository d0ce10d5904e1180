"""train-rm's margin and centring (issue 52) before the ranks: the config refuses bad
values naming the field, a pair file's margin column is read (and refused naming the
line when missing or not a finite number), and the held-out metrics are the formula."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rollout.preference_pairs import PreferenceDataError, read_preference_pairs
from services.config.errors import ConfigError
from services.train_rm.config import parse_reward_model_config
from services.train_rm.report import held_out_metrics


def _config(text: str) -> object:
    return parse_reward_model_config(text, source="rm.yaml")


@pytest.mark.parametrize(("text", "message"), [
    ("center_rewards_coefficient: -0.1", "center_rewards_coefficient: Input should be "
                                         "greater than or equal to 0"),
    ("center_rewards_coefficient: .nan", "center_rewards_coefficient: Input should be a "
                                         "finite number"),
    ("center_rewards_coefficient: .inf", "center_rewards_coefficient: Input should be a "
                                         "finite number"),
    ("center_rewards_coefficient: 1.0e+7", "center_rewards_coefficient: Input should be "
                                           "less than or equal to 1000000"),
    ("center_rewards_coefficient: lots", "center_rewards_coefficient: Input should be a "
                                         "valid number"),
])
def test_a_bad_centring_coefficient_is_refused_naming_the_field(text: str,
                                                                message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(f"data: {{train: x.jsonl}}\n{text}\n")
    assert str(err.value).startswith(f"rm.yaml: {message}"), str(err.value)


@pytest.mark.parametrize(("value", "message"), [
    ("prompt", "data.margin: 'prompt' cannot be the margin column"),
    ("kind", "data.margin: 'kind' cannot be the margin column"),
    ("''", "data.margin: '' cannot be the margin column"),
    ("1", "data.margin: Input should be a valid boolean"),
])
def test_a_bad_margin_column_is_refused_naming_the_field(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(f"data: {{train: x.jsonl, margin: {value}}}\n")
    assert str(err.value).startswith(f"rm.yaml: {message}"), str(err.value)


def test_the_margin_column_and_coefficient_are_read() -> None:
    plain = _config("data: {train: x.jsonl}\n")
    assert plain.data.margin_key is None and plain.center_rewards_coefficient == 0.0
    named = _config("data: {train: x.jsonl, margin: true}\ncenter_rewards_coefficient: 0.01\n")
    assert named.data.margin_key == "margin" and named.center_rewards_coefficient == 0.01
    assert _config("data: {train: x.jsonl, margin: gap}\n").data.margin_key == "gap"


def _write(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_margins_are_read_from_the_named_column(tmp_path: Path) -> None:
    base = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    path = _write(tmp_path / "pairs.jsonl", [{**base, "gap": 1.5}, {**base, "gap": -2}])
    assert [p.margin for p in read_preference_pairs(path, "data.train", "gap")] == [1.5, -2.0]
    # no margin column asked for: a "margin" key is ignored like any other
    other = _write(tmp_path / "other.jsonl", [{**base, "margin": 3.0}])
    assert read_preference_pairs(other, "data.train")[0].margin == 0.0


@pytest.mark.parametrize(("value", "message"), [
    (None, 'missing "margin" (the margin column, data.margin)'),
    ("1.0", '"margin" (the margin) must be a finite number, got "1.0"'),
    (True, '"margin" (the margin) must be a finite number, got true'),
    (math.inf, '"margin" (the margin) must be a finite number, got Infinity'),
])
def test_a_missing_or_bad_margin_is_refused_with_its_line(tmp_path: Path, value: object,
                                                           message: str) -> None:
    base = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    bad = {**base} if value is None else {**base, "margin": value}
    path = _write(tmp_path / "pairs.jsonl", [{**base, "margin": 0.5}, bad])
    with pytest.raises(PreferenceDataError) as err:
        read_preference_pairs(path, "data.train", "margin")
    assert str(err.value) == f"{path} line 2: {message}"


def test_held_out_metrics_are_the_loss_with_margin_and_centring() -> None:
    chosen, rejected, margins, c = [0.4, -1.0, 2.5], [0.1, 0.3, -0.5], [1.0, -0.5, 0.0], 0.1
    scores = torch.tensor([s for pair in zip(chosen, rejected, strict=True) for s in pair],
                          dtype=torch.float64)
    metrics = held_out_metrics(scores, ["a", "b", "a"], margins, c)
    terms = [(math.log1p(math.exp(-(p - r - m))), (p + r) ** 2)
             for p, r, m in zip(chosen, rejected, margins, strict=True)]
    assert metrics["eval/loss"] == pytest.approx(sum(b + c * s for b, s in terms) / 3,
                                                 rel=1e-14)
    assert metrics["eval/loss/bradley_terry"] == pytest.approx(sum(b for b, _ in terms) / 3)
    assert metrics["eval/score/centring"] == pytest.approx(sum(s for _, s in terms) / 3)
    assert metrics["eval/accuracy"] == pytest.approx(2 / 3)
    assert metrics["eval/accuracy/a"] == 1.0 and metrics["eval/accuracy/b"] == 0.0
