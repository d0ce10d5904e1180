"""``tally verify-objective`` (services/verify/objective/): every term of the demo job holds
to its documented formula through production's code (exit 0), each planted error fails
exactly its own term's rows (exit 1), every built-in policy loss and KL estimator has a
formula, and the variants the rows claim to test are active (their J moves)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from services.cli import verify
from services.cli.common import mapped
from services.config.job import JobConfig, load_job_config
from services.verify.objective import (
    PLANTED_ERRORS,
    TOLERANCE,
    Result,
    check_temperatures,
    results,
    verify_objective,
)
from services.verify.objective.formulas import KL_FORMULAS, POLICY_FORMULAS
from services.verify.objective.setting import Setting, build_setting
from trainer.config import LossConfig
from trainer.losses import POLICY_LOSSES

DEMO = Path(__file__).parents[3] / "configs" / "demo.yaml"


@pytest.fixture(scope="module")
def setting() -> Setting:
    return build_setting()


@pytest.fixture(scope="module")
def demo_job() -> JobConfig:
    return load_job_config(DEMO, [])


@pytest.fixture(scope="module")
def clean(demo_job: JobConfig, setting: Setting) -> dict[str, Result]:
    loss, rollout = demo_job.trainer.loss, demo_job.rollout
    rows = results(loss, rollout.sampling.temperature, demo_job.critic.value_clip,
                   setting=setting)
    return {row.name: row for row in rows}


def test_every_builtin_policy_loss_and_kl_estimator_has_a_formula() -> None:
    missing = set(POLICY_LOSSES) - set(POLICY_FORMULAS)
    assert not missing, f"built-in policy losses without a documented formula: {missing}"
    estimators = typing.get_args(LossConfig.model_fields["kl_estimator"].annotation)
    assert set(estimators) <= set(KL_FORMULAS)


def test_every_term_of_the_demo_holds_to_its_formula(clean: dict[str, Result]) -> None:
    failed = {name: (row.gradient_error, row.value_error)
              for name, row in clean.items() if not row.ok}
    assert not failed
    for name in POLICY_LOSSES:
        assert f"pg/{name} on-policy" in clean and f"pg/{name} off-policy" in clean
    for estimator in KL_FORMULAS:
        assert f"kl/{estimator}" in clean
    assert {"entropy", "value unclipped", "bt"} <= set(clean)
    assert any(name.startswith("correction/") for name in clean)
    # a row comparing zeros only is no check: all but the two whose documented
    # expected gradient is 0 (k1; cross-entropy on its own samples) have a real one
    zero = {name for name, row in clean.items() if row.scale < 1e-6}
    assert zero == {"kl/k1", "pg/cross_entropy on-policy"}


def test_the_variants_the_rows_name_are_active(clean: dict[str, Result]) -> None:
    """A dual clip that never bites, or a correction band no weight leaves, would pass
    without testing anything: their J must differ from the plain row's."""
    value = {name: row.value for name, row in clean.items()}
    assert abs(value["pg/ppo dual-clip off-policy"] - value["pg/ppo off-policy"]) > 1e-3
    pairs = [(name, name.replace("-truncate ", "-mask ")) for name in value
             if name.startswith("correction/") and "-truncate " in name
             and name.replace("-truncate ", "-mask ") in value]
    assert len(pairs) == 6  # token, sequence, geometric × ppo, importance_sampling
    for truncate, mask in pairs:
        assert abs(value[truncate] - value[mask]) > 1e-4
    assert abs(value["kl/k2"] - value["kl/k3+"]) > 1e-3  # k2's value is not KL's


def test_second_temperature_when_the_job_samples_at_one() -> None:
    assert check_temperatures(1.0) == (1.0, 0.7)
    assert check_temperatures(0.6) == (0.6,)


@pytest.mark.slow
@pytest.mark.parametrize("planted", sorted(PLANTED_ERRORS))
def test_each_planted_error_fails_its_own_rows(planted: str, demo_job: JobConfig,
                                               setting: Setting) -> None:
    families = PLANTED_ERRORS[planted][0]
    lines: list[str] = []
    code = verify_objective(demo_job.trainer.loss, demo_job.rollout.sampling.temperature,
                            demo_job.critic.value_clip, planted={planted},
                            echo=lines.append, setting=setting)
    assert code == 1
    assert lines[-1].endswith("terms hold to their formula") and "FAIL" in "\n".join(lines)
    rows = results(demo_job.trainer.loss, demo_job.rollout.sampling.temperature,
                   demo_job.critic.value_clip, planted={planted}, setting=setting)
    failed = {row.family for row in rows if not row.ok}
    assert failed == set(families)
    worst = max(max(row.gradient_error, row.value_error) for row in rows if not row.ok)
    assert worst > 1e3 * TOLERANCE  # far beyond rounding


def test_an_unknown_planted_error_is_refused(demo_job: JobConfig) -> None:
    with pytest.raises(ValueError, match="planted: unknown error 'nope'"):
        results(demo_job.trainer.loss, 1.0, 0.2, planted={"nope"})


def test_the_command_exits_0_on_the_demo_and_prints_a_row_per_term() -> None:
    app = typer.Typer()
    app.command("verify-objective")(mapped(verify.verify_objective))
    app.command("other")(lambda: None)  # two commands: typer keeps the name
    outcome = CliRunner().invoke(app, ["verify-objective", str(DEMO)])
    assert outcome.exit_code == 0, outcome.output
    lines = outcome.output.splitlines()
    assert lines[-1].split()[0].split("/")[0] == lines[-1].split()[0].split("/")[1]
    assert any(line.startswith("kl/k3+") and line.endswith("ok") for line in lines)


def test_a_registry_entry_without_a_formula_is_skipped_with_a_note(
        demo_job: JobConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.verify.objective import rows

    monkeypatch.setitem(rows.POLICY_LOSSES, "made_up", POLICY_LOSSES["ppo"])
    notes: list[str] = []
    checks = rows.policy_checks(demo_job.trainer.loss, notes.append)
    assert notes == ["note: policy loss 'made_up' has no documented formula in "
                     "services/verify/objective/formulas.py; skipped"]
    assert not any("made_up" in check.name for check in checks)
    assert {check.name for check in checks} >= {f"pg/{name} on-policy" for name in POLICY_LOSSES
                                                if name != "made_up"}
