"""The `tally` commands users run, in process (Typer's runner) on the test Ray cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


README_LAYOUTS = "dp1cp1-padded,dp2cp1,dp1cp2"  # packed rows against one padded rank
# demo.yaml exactly as the README says: the other demo configs differ from it in their
# aggregation mode only, and the verifier checks every mode whatever the job's
# (max_response_len's resolution: tests/services/test_config.py). Every shipped config is
# validated in test_config.py.
DEMO_CONFIGS = ["demo.yaml"]
SMALLER = ["--set", "rollout.global_batch_size=16"]


def _rows(output: str) -> list[list[str]]:
    return [line.split() for line in output.splitlines() if line.startswith("dp")]


@pytest.mark.parametrize("config", DEMO_CONFIGS)
def test_readme_verify_aggregation_command_passes_on_every_config(
        ray_cluster: None, shared_data_dir: Path, config: str) -> None:
    result = runner.invoke(app, ["verify-aggregation", str(ROOT / "configs" / config),
                                 "--layouts", README_LAYOUTS,
                                 *([] if config == "demo.yaml" else SMALLER)])
    assert result.exit_code == 0, result.output
    rows = _rows(result.output)
    assert {(r[0], r[1], r[2], r[3]) for r in rows} == {
        (layout, mode, "0", term) for layout in ("dp2cp1", "dp1cp2")
        for mode in ("sample_mean", "token_mean", "prompt_mean", "constant")
        for term in ("pg", "kl", "entropy")}
    assert all(r[-1] == "ok" for r in rows)
    assert "24/24 comparisons within tolerance" in result.output


def test_verify_aggregation_exits_1_on_a_planted_reduction_error(
        ray_cluster: None, shared_data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TALLY_TEST_PLANT", "dp2cp1:pg,kl")  # rank 0 of dp2cp1 doubles them
    result = runner.invoke(app, ["verify-aggregation", str(ROOT / "configs" / "demo.yaml"),
                                 "--layouts", "dp1cp1,dp2cp1", *SMALLER])
    assert result.exit_code == 1, result.output
    header = next(line for line in result.output.splitlines() if line.startswith("layout"))
    assert header.split() == ["layout", "mode", "update", "term", "|Δgrad|", "rel", "|ΔJ|",
                              "rel", "result"]
    rows = _rows(result.output)
    failed = {(r[1], r[3]) for r in rows if r[-1] == "FAIL"}
    assert failed == {(mode, term) for mode in ("sample_mean", "token_mean", "prompt_mean",
                                                "constant") for term in ("pg", "kl")}
    for row in rows:  # absolute and relative gradient differences: large where planted
        assert (float(row[5]) > 0.01) == (row[-1] == "FAIL"), row
    assert "4/12 comparisons within tolerance" in result.output


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


def test_import_model_copies_a_valid_folder_and_names_a_bad_source(smollm2_path: Path,
                                                                    tmp_path: Path) -> None:
    result = runner.invoke(app, ["import-model", str(smollm2_path), str(tmp_path / "copy")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "copy" / "config.json").read_text() == (
        smollm2_path / "config.json").read_text()
    assert list((tmp_path / "copy").glob("*.safetensors"))
    again = runner.invoke(app, ["import-model", str(smollm2_path), str(tmp_path / "copy")])
    assert again.exit_code == 2 and "already exists" in again.output
    missing = runner.invoke(app, ["import-model", str(tmp_path / "nope.gguf"),
                                  str(tmp_path / "out")])
    assert missing.exit_code == 2 and "neither a .gguf file" in missing.output
