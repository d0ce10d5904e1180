"""The `tally` commands users run, in process (Typer's runner) on the test Ray cluster;
`tally train` with no cluster also as a process of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app
from tests.services.driver.clean_run import CLEAN, CleanRun, deterministic, rows

ROOT = Path(__file__).resolve().parents[3]
runner = CliRunner()


README_LAYOUTS = "dp1cp1-padded,dp2cp1-prefix,dp1cp2"  # shared-prefix and CP rows vs padding
# demo.yaml exactly as the README says: the other demo configs differ from it in their
# aggregation mode only, and the verifier checks every mode whatever the job's
# (max_response_len's resolution: tests/services/config/test_job.py). Every shipped config is
# validated in test_config.py.
DEMO_CONFIGS = ["demo.yaml"]
SMALLER = ["--set", "rollout.global_batch_size=16"]


def _rows(output: str) -> list[list[str]]:
    return [line.split() for line in output.splitlines() if line.startswith("dp")]


@pytest.mark.slow
@pytest.mark.parametrize("config", DEMO_CONFIGS)
def test_readme_verify_aggregation_command_passes_on_every_config(
        ray_cluster: None, shared_data_dir: Path, config: str) -> None:
    result = runner.invoke(app, ["verify-aggregation", str(ROOT / "configs" / config),
                                 "--layouts", README_LAYOUTS,
                                 *([] if config == "demo.yaml" else SMALLER)])
    assert result.exit_code == 0, result.output
    rows = _rows(result.output)
    assert {(r[0], r[1], r[2], r[3]) for r in rows} == {
        (layout, mode, "0", term) for layout in ("dp2cp1-prefix", "dp1cp2")
        for mode in ("sample_mean", "token_mean", "prompt_mean", "constant")
        for term in ("pg", "kl", "entropy")}
    assert all(r[-1] == "ok" for r in rows)
    assert "24/24 comparisons within tolerance" in result.output


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


def ray_processes_under(folder: Path) -> list[str]:
    """Command lines of the live processes that name ``folder`` (a Ray head's temp dir:
    its GCS, raylet, agents and workers all carry it)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, PermissionError, ProcessLookupError, NotADirectoryError):
            continue
        if str(folder) in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.mark.slow  # a Ray head and a job of its own
def test_tally_train_without_a_cluster_starts_and_stops_its_own_head(
        clean_run: CleanRun, tmp_path: Path) -> None:
    """The real command in its own process, no RAY_ADDRESS: it starts a Ray head of its
    own (under RAY_TMPDIR, kept short for Ray's socket paths), runs the clean job's first
    step — the same row as the clean run — writes TensorBoard event files that hold that
    row, and leaves no process of its head behind."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ray_tmp = Path(tempfile.mkdtemp(prefix="tally-cli-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(ray_tmp)
    job = tmp_path / "job"
    sets = [arg for value in [*CLEAN, "num_steps=1"] for arg in ("--set", value)]
    try:
        result = subprocess.run(
            [str(Path(sys.executable).parent / "tally"), "train",
             str(ROOT / "configs" / "demo.yaml"), *sets, "--output-dir", str(job)],
            env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        (session,) = (ray_tmp / "ray").glob("session_2*")  # its head ran there
        assert (session / "logs" / "raylet.out").exists()
        deadline = time.monotonic() + 60  # the head's last processes may take a moment
        while (left := ray_processes_under(ray_tmp)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, left
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    (row,) = rows(job / "metrics.jsonl")
    assert deterministic(row["metrics"]) == deterministic(
        rows(clean_run.path / "metrics.jsonl")[0]["metrics"])
    events = EventAccumulator(str(job / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = {k: v for k, v in row["metrics"].items() if v is not None}
    assert set(events.Tags()["scalars"]) == set(logged)
    for name, value in logged.items():
        (scalar,) = events.Scalars(name)
        assert scalar.step == 0
        assert scalar.value == pytest.approx(value, rel=1e-6, abs=1e-30), name


@pytest.mark.slow
def test_export_writes_a_checkpoint_as_the_jobs_final_weights(clean_run: CleanRun,
                                                              tmp_path: Path) -> None:
    """`tally export` of the last checkpoint gives what the job itself exported at its end
    (the trained fp32 weights, bit for bit), and in bf16 on request; a folder that is no
    checkpoint is one line and exit 2."""
    from safetensors.torch import load_file

    from tests.services.driver.clean_run import final_weights

    last = clean_run.path / "checkpoints" / "step_00000003"
    result = runner.invoke(app, ["export", str(last), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tmp_path / "hf")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    job = final_weights(clean_run.path)
    assert exported.keys() == job.keys() and all(
        exported[name].equal(tensor) for name, tensor in job.items())
    assert {"config.json", "tokenizer.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}

    result = runner.invoke(app, ["export", str(last), str(tmp_path / "half"), "--dtype",
                                 "bfloat16"])
    assert result.exit_code == 0, result.output
    half = load_file(str(tmp_path / "half" / "model.safetensors"))
    assert all(half[name].equal(tensor.bfloat16()) for name, tensor in job.items())

    result = runner.invoke(app, ["export", str(tmp_path), str(tmp_path / "none")])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: {tmp_path}: not a Tally checkpoint (no "
                                     "model/config.json)")
    assert not (tmp_path / "none").exists()


def test_version_and_dash_h_on_every_command() -> None:
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"tally {version('tally')}\n"
    names = [command.name or command.callback.__name__ for command in app.registered_commands]
    assert {"train", "validate", "eval", "export", "status"} <= set(names)
    for name in names:
        result = runner.invoke(app, [name, "-h"])
        assert result.exit_code == 0 and "Usage: " in result.output, name
    assert runner.invoke(app, ["-h"]).exit_code == 0


def test_validate_runs_every_check_and_starts_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ray(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("validate must start nothing")

    monkeypatch.setattr("services.runtime.gang.ensure_ray", no_ray)
    result = runner.invoke(app, ["validate", str(ROOT / "configs" / "demo.yaml"),
                                 "--set", "num_steps=7"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == (
        "ok: demo: 7 rollout steps of 32 prompts × 8 samples, 1 optimizer step(s) each, "
        "sample_mean, model tiny, fsdp dp=2 cp=1")
    result = runner.invoke(app, ["validate", str(ROOT / "configs" / "demo.yaml"),
                                 "--set", f"rollout.model={tmp_path / 'no-model'}"])
    assert result.exit_code == 2
    assert result.stderr.startswith("rollout.model: "), result.stderr
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(("overrides", "exit_code"), [
    (["kl_estimator=k1"], 2), (["kl_estimator=k3"], 2), (["kl_estimator=low_var_kl"], 2),
    (["kl_estimator=k1", "allow_biased_kl_gradient=true"], 2),
    (["kl_estimator=k3", "allow_biased_kl_gradient=true"], 0),
    (["kl_estimator=k2"], 0), (["kl_estimator=k3+"], 0), ([], 0)])
def test_validate_refuses_a_kl_loss_without_the_reverse_kl_gradient(
        overrides: list[str], exit_code: int) -> None:
    """trainer/losses/kl.py: as a loss, k1's expected gradient is 0 and k3's the forward
    KL's; the refusal names the field and says why."""
    sets = [a for o in ["kl_coef=0.1", *overrides] for a in ("--set", f"trainer.loss.{o}")]
    result = runner.invoke(app, ["validate", str(ROOT / "configs" / "demo.yaml"), *sets])
    assert result.exit_code == exit_code, result.output
    if exit_code:
        assert "trainer.loss: kl_estimator: " in result.stderr
        assert "expected gradient" in result.stderr


def test_resume_and_no_resume_together_are_refused(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", str(ROOT / "configs" / "demo.yaml"), "--resume",
                                 "auto", "--no-resume", "--output-dir", str(tmp_path / "j")])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: --resume and --no-resume: choose one"


def test_status_of_a_failed_job_says_its_cause_once_and_exits_1(tmp_path: Path) -> None:
    from services.controller.app import create_app
    from tests.services.controller.fakes import FakeBackend, make_settings, serve_in_thread
    from tests.services.controller.test_cli import in_ray

    backend = FakeBackend()
    with serve_in_thread(create_app(make_settings(tmp_path), backend=backend)) as url:
        result = runner.invoke(app, ["submit", str(ROOT / "configs" / "demo.yaml"), "--url",
                                     url])
        job_id = result.output.split()[1]
        in_ray(backend, job_id)
        cause = "job demo: the rollout manager failed to start: DatasetError: x.jsonl: gone"
        backend.finish(f"tally-{job_id}", "failed",
                       f"loading\nstep 0 (1/20 done) | reward 0.1\nerror: {cause}\n",
                       "Job entrypoint command failed with exit code 1")
        deadline = time.monotonic() + 60
        while (result := runner.invoke(app, ["status", job_id, "--url", url])).exit_code == 0:
            assert time.monotonic() < deadline, result.output
            time.sleep(0.2)
    assert result.exit_code == 1
    assert result.output.count("the rollout manager failed to start") == 1, result.output
    assert result.output.splitlines()[-1] == f"error: {cause}"
    assert "  step 0 (1/20 done) | reward 0.1" in result.output
    assert "status:" in result.output and "failed" in result.output
