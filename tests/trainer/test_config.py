"""AggregationConfig validation: one test per rule, asserting the message names the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig


def test_default_is_sample_mean() -> None:
    assert AggregationConfig().mode == "sample_mean"


def test_constant_without_divisor() -> None:
    with pytest.raises(ValidationError, match="divisor: mode=constant needs a divisor"):
        AggregationConfig(mode="constant")


@pytest.mark.parametrize("divisor", [0.0, -3.0, float("inf"), float("nan")])
def test_divisor_must_be_finite_and_positive(divisor: float) -> None:
    with pytest.raises(ValidationError, match="divisor: must be finite and > 0"):
        AggregationConfig(mode="constant", divisor=divisor)


def test_divisor_with_other_mode() -> None:
    with pytest.raises(ValidationError, match="divisor: only mode=constant takes a divisor"):
        AggregationConfig(mode="token_mean", divisor=1024)


@pytest.mark.parametrize("mode", ["prompt_mean", "constant"])
def test_legacy_flag_conflicts(mode: str) -> None:
    expected = f"calculate_per_token_loss.*conflicts with mode={mode}"
    with pytest.raises(ValidationError, match=expected):
        AggregationConfig(mode=mode, divisor=8 if mode == "constant" else None,
                          calculate_per_token_loss=True)


def test_legacy_flag_alone_becomes_token_mean() -> None:
    assert AggregationConfig(calculate_per_token_loss=True).mode == "token_mean"
    assert AggregationConfig(mode="token_mean", calculate_per_token_loss=True).mode == "token_mean"


def test_max_response_len_resolves_once_when_the_objective_is_composed() -> None:
    config = AggregationConfig(mode="constant", divisor="max_response_len")
    objective = ObjectiveConfig.compose(config, LossConfig(), 512, 0.8)
    assert objective.pg.divisor == 512.0 and objective.kl.divisor == 512.0
    assert objective.temperature == 0.8
    with pytest.raises(ValueError, match="must be resolved"):
        _ = config.numeric_divisor
    with pytest.raises(ValidationError, match=r"pg\.divisor: resolve 'max_response_len'"):
        ObjectiveConfig(pg=config)


def test_kl_and_entropy_aggregation_accept_only_what_they_honour() -> None:
    with pytest.raises(ValidationError, match="custom_reducer"):
        LossConfig(kl_aggregation={"mode": "token_mean", "custom_reducer": "m:f"})
    with pytest.raises(ValidationError, match="aggregation"):
        LossConfig(aggregation={"mode": "token_mean"})
    loss = LossConfig(entropy_aggregation={"mode": "constant", "divisor": 4})
    objective = ObjectiveConfig.compose(AggregationConfig(mode="token_mean"), loss, 9, 1.0)
    assert (objective.kl.mode, objective.entropy.mode) == ("token_mean", "constant")


def test_unknown_mode_and_unknown_key_are_named() -> None:
    with pytest.raises(ValidationError, match="mode"):
        AggregationConfig(mode="seq_mean")
    with pytest.raises(ValidationError, match="reducer_path"):
        AggregationConfig(reducer_path="x:y")


def test_custom_reducer_path_shape() -> None:
    with pytest.raises(ValidationError, match="custom_reducer: expected 'module:function'"):
        AggregationConfig(custom_reducer="not a path")
