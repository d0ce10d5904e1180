"""The `tally` commands users run, in process (Typer's runner) on the test Ray cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_verify_aggregation_prints_a_row_per_layout_and_mode(
        ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TALLY_DATA_DIR", str(tmp_path))
    result = runner.invoke(app, [
        "verify-aggregation", str(ROOT / "configs" / "demo.yaml"), "--layouts", "dp1cp1,dp2cp1",
        "--set", "warmup.num_steps=40", "--set", "rollout.global_batch_size=8",
        "--set", "rollout.n_samples_per_prompt=4", "--set", "trainer.optimizer.type=sgd",
        "--set", "trainer.optimizer.grad_clip=null"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()
            if line.startswith(("dp1cp1", "dp2cp1"))]
    assert [(r[0], r[1]) for r in rows] == [
        (layout, mode) for layout in ("dp1cp1", "dp2cp1")
        for mode in ("sample_mean", "token_mean", "prompt_mean", "constant")]
    assert all(float(value) < 1e-5 for row in rows for value in row[2:])
    assert "max relative difference" in result.output


def test_train_rejects_a_bad_config_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  sampling:\n    temperature: -1\n")
    result = runner.invoke(app, ["train", str(bad)])
    assert result.exit_code == 2
    assert "rollout.sampling.temperature: Input should be greater than or equal to 0" in (
        result.output)


def test_tally_train_and_python_m_services_train_share_one_entry_point(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.train import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("aggregation: {mode: constant}\n")
    args = [str(bad), "--set", "num_steps=3", "--output-dir", str(tmp_path / "out")]
    result = runner.invoke(app, ["train", *args])
    assert main(args) == 2
    module_err = capsys.readouterr().err
    assert result.exit_code == 2
    assert result.stderr == module_err  # the same function printed both
    assert "aggregation: divisor: mode=constant needs a divisor" in module_err
    assert not (tmp_path / "out").exists()


def test_schema_commands_print_the_committed_files() -> None:
    assert runner.invoke(app, ["schema"]).output == (
        ROOT / "configs" / "tally.schema.json").read_text()
    assert runner.invoke(app, ["schema", "--markdown"]).output == (
        ROOT / "docs" / "configuration.md").read_text()
