r"""``tally verify-objective``: each loss term held to its documented formula, exactly.

On a tiny float64 policy over a small vocabulary (setting.py), every term and variant —
pg under each registered policy loss, on- and off-policy, with each off-policy
correction; KL under each estimator; entropy; the critic's clipped value loss;
Bradley–Terry — has its **expected** J and ∇J computed exactly (a sum over every outcome,
weighted by the sampling distribution, no sampling) through production's per-token code
(production.py), and compared with autograd of the term's documented formula written in
formulas.py, in float64, to ``TOLERANCE``. verify-aggregation holds each layout to the
reference layout; this holds the reference itself to the math. No Ray, CPU, seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.verify.objective.planted import PLANTED_ERRORS, planted_production

if TYPE_CHECKING:
    from services.verify.objective.setting import Setting
    from trainer.config import LossConfig

TOLERANCE = 1e-10
"""Largest |Δ| of any gradient entry or of J (float64)."""
SECOND_TEMPERATURE = 0.7
"""Added when the job samples at T = 1, where a dropped temperature would not show."""
DEFAULT_VALUE_CLIP = 0.2
"""The clipped value row's ε when the job's critic has none (``critic.value_clip: null``)."""

__all__ = ["PLANTED_ERRORS", "TOLERANCE", "Result", "check_temperatures", "verify_objective"]


@dataclass(frozen=True)
class Result:
    """One row: the worst over the temperatures it ran at."""

    name: str
    family: str
    value: float
    """J of the documented formula (at the first temperature)."""
    scale: float
    """max |∇J| of the documented formula (a row comparing zeros shows as 0)."""
    gradient_error: float
    value_error: float

    @property
    def ok(self) -> bool:
        worst = max(self.gradient_error, self.value_error)
        return worst == worst and worst <= TOLERANCE  # NaN fails


def check_temperatures(temperature: float) -> tuple[float, ...]:
    """The job's sampling temperature, and a second when it is 1."""
    return (temperature,) if temperature != 1.0 else (1.0, SECOND_TEMPERATURE)


def results(loss: LossConfig, temperature: float, value_clip: float | None,
            planted: Iterable[str] = (), echo: Callable[[str], None] = print,
            setting: Setting | None = None) -> list[Result]:
    """Every row's Result (``planted``: errors put into production's functions, tests;
    ``setting``: one already built, else the seed-0 one)."""
    from services.verify.objective.rows import (
        policy_checks,
        run_pair_check,
        run_policy_check,
        run_value_check,
    )
    from services.verify.objective.setting import build_setting

    production = planted_production(frozenset(planted))
    setting = setting if setting is not None else build_setting()
    out = []
    for check in policy_checks(loss, echo):
        runs = [run_policy_check(check, setting, production, t)
                for t in check_temperatures(temperature)]
        out.append(Result(check.name, check.family, runs[0][0],
                          *(max(r[i] for r in runs) for i in range(1, 4))))
    epsilon = value_clip if value_clip is not None else DEFAULT_VALUE_CLIP
    for name, clip in ((f"value clip={epsilon:g}", epsilon), ("value unclipped", None)):
        out.append(Result(name, "value", *run_value_check(setting, production, temperature,
                                                          clip)))
    out.append(Result("bt", "bt", *run_pair_check(setting, production, with_margin=False)))
    out.append(Result("bt margin+centring", "bt",
                      *run_pair_check(setting, production, with_margin=True)))
    return out


def verify_objective(loss: LossConfig, temperature: float, value_clip: float | None,
                     planted: Iterable[str] = (), echo: Callable[[str], None] = print,
                     setting: Setting | None = None) -> int:
    """Print one row per term and variant; 0 when every row is within TOLERANCE, else 1."""
    temperatures = ", ".join(f"{t:g}" for t in check_temperatures(temperature))
    echo(f"exact expected J and ∇J, production vs documented formula, float64; "
         f"T = {temperatures}; tolerance {TOLERANCE:.0e}")
    rows = results(loss, temperature, value_clip, planted, echo, setting)
    width = max(len(row.name) for row in rows)
    echo(f"{'term':<{width}}  {'J':>10}  {'max|∇J|':>9}  {'max|Δ∇J|':>9}  {'|ΔJ|':>9}")
    for row in rows:
        echo(f"{row.name:<{width}}  {row.value:+10.4f}  {row.scale:9.2e}  "
             f"{row.gradient_error:9.2e}  "
             f"{row.value_error:9.2e}  {'ok' if row.ok else 'FAIL'}")
    failed = [row for row in rows if not row.ok]
    echo(f"{len(rows) - len(failed)}/{len(rows)} terms hold to their formula")
    return 1 if failed else 0
