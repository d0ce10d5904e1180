"""Configuration schemas of the trainer. Imports only pydantic, so a job can be
validated (by the controller, at submit time) without torch or Ray."""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AggregationMode = Literal["sample_mean", "token_mean", "prompt_mean", "constant"]
AGGREGATION_MODES: tuple[AggregationMode, ...] = (
    "sample_mean",
    "token_mean",
    "prompt_mean",
    "constant",
)
MAX_RESPONSE_LEN = "max_response_len"
_REDUCER_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class AggregationConfig(BaseModel):
    """How per-token losses of one optimizer step become one scalar objective J.

    See docs/loss-aggregation.md for the formulas of each mode.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: AggregationMode = "sample_mean"
    """Aggregation mode: sample_mean (default), token_mean, prompt_mean or constant."""
    divisor: float | Literal["max_response_len"] | None = None
    """Constant L for mode=constant: a finite number > 0, or `max_response_len`
    (Dr. GRPO's generation budget, resolved against the rollout's max new tokens)."""
    calculate_per_token_loss: bool = False
    """Legacy spelling of mode=token_mean (slime's --calculate-per-token-loss)."""
    custom_reducer: str | None = None
    """`module:function` returning per-token weights; overrides `mode` for the pg term."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_per_token_flag(cls, data: object) -> object:
        """`calculate_per_token_loss: true` alone means token_mean; with prompt_mean or
        constant it is a contradiction the user must resolve."""
        if not isinstance(data, dict) or not data.get("calculate_per_token_loss"):
            return data
        mode = data.get("mode", "token_mean")
        if mode in ("prompt_mean", "constant"):
            raise ValueError(
                f"calculate_per_token_loss: true is the legacy spelling of mode=token_mean "
                f"and conflicts with mode={mode}; remove calculate_per_token_loss or set "
                f"mode: token_mean"
            )
        return {**data, "mode": "token_mean"}

    @model_validator(mode="after")
    def _divisor_matches_mode(self) -> AggregationConfig:
        if self.mode == "constant":
            if self.divisor is None:
                raise ValueError(
                    "divisor: mode=constant needs a divisor (a finite number > 0, or "
                    "'max_response_len')"
                )
            if isinstance(self.divisor, float) and not (
                math.isfinite(self.divisor) and self.divisor > 0
            ):
                raise ValueError(
                    f"divisor: must be finite and > 0 for mode=constant, got {self.divisor}"
                )
        elif self.divisor is not None:
            raise ValueError(
                f"divisor: only mode=constant takes a divisor, but mode={self.mode}"
            )
        if self.custom_reducer is not None and not _REDUCER_PATH.match(self.custom_reducer):
            raise ValueError(
                f"custom_reducer: expected 'module:function', got {self.custom_reducer!r}"
            )
        return self

    def resolved_divisor(self, max_response_len: int | None = None) -> float | None:
        """The numeric L, resolving `max_response_len` against the rollout's budget."""
        if self.divisor == MAX_RESPONSE_LEN:
            if max_response_len is None:
                raise ValueError(
                    "divisor: 'max_response_len' needs the rollout's max new tokens"
                )
            return float(max_response_len)
        return self.divisor


class LossTermConfig(BaseModel):
    """A regulariser (KL or entropy): its coefficient and, optionally, its own mode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    coef: float = Field(default=0.0, ge=0.0)
    """Weight of this term in the total loss; 0 disables it."""
    aggregation: AggregationConfig | None = None
    """Aggregation for this term; defaults to the pg term's (without its custom reducer)."""
