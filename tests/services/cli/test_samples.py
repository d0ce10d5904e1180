"""``tally samples`` on the samples.jsonl of a real job (the session's clean run,
tests/services/driver/clean_run.py: 4 rollout steps, 8 samples logged each), read in its
folder and through a controller over real HTTP; a copy with a planted record shows long
text shortened and terminal escapes never reaching the terminal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
from typer.testing import CliRunner

from services.cli import app
from services.cli.samples import RESPONSE_CHARS, escaped, shortened
from services.controller.app import create_app
from services.driver.run_dir import CONFIG_FILE, SAMPLES_FILE
from services.driver.samples import append_samples, read_samples
from tests.services.controller.fakes import FakeBackend, make_settings, serve_in_thread
from tests.services.driver.clean_run import CleanRun

runner = CliRunner()


def samples(*args: str):
    return runner.invoke(app, ["samples", *args])


def json_lines(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines()]


def test_a_job_folder_shows_its_newest_step_each_sample_in_a_block(clean_run: CleanRun) -> None:
    path = clean_run.path / SAMPLES_FILE
    newest = read_samples(path, step=3, evaluation=False)
    assert len(newest) == 8 and not read_samples(path, evaluation=True)
    result = samples(str(clean_run.path))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == (f"{clean_run.path}: training samples of step 3, 8 of 8; steps with "
                        "samples: 0-3")
    heads = [line for line in lines if line.startswith("step ")]
    assert len(heads) == 8
    for row, head in zip(newest, heads, strict=True):
        assert head == (f"step 3 · group {row['group']} · #{row['index']} · reward "
                        f"{row['reward']:.3f} (exact_match {row['rewards']['exact_match']:.3f})"
                        f" · advantage {row['advantage']:+.3f} · {row['response_tokens']} tokens")
    shown = [line.removeprefix("  response  ") for line in lines
             if line.startswith("  response  ")]
    assert shown == [escaped(shortened(r["response"], *RESPONSE_CHARS)) for r in newest]
    assert [line for line in lines if line.startswith("  label     ")] == [
        f"  label     {r['label']}" for r in newest]


def test_json_a_chosen_step_and_clear_refusals(clean_run: CleanRun, tmp_path: Path) -> None:
    path = clean_run.path / SAMPLES_FILE
    result = samples(str(clean_run.path), "--step", "1", "--json")
    assert result.exit_code == 0, result.output
    assert json_lines(result.stdout) == read_samples(path, step=1, evaluation=False)
    assert json_lines(samples(str(path), "--step", "0", "--json", "--limit", "3").stdout) == \
        read_samples(path, step=0)[:3]  # samples.jsonl itself names its folder
    for args, message in (
            (["--step", "9"], f"error: {clean_run.path}: no training samples at step 9; steps "
                              "with training samples: 0-3"),
            (["--eval"], f"error: {clean_run.path}: no evaluation samples; training samples "
                         "at steps 0-3: leave out --eval")):
        result = samples(str(clean_run.path), *args)
        assert (result.exit_code, result.stderr.splitlines()) == (1, [message])
    for folder, message in ((tmp_path, f"error: {tmp_path}: no samples.jsonl (the job has not "
                             "finished a rollout step yet, or is not a Tally job folder)"),
                            (tmp_path / "gone", f"error: {tmp_path / 'gone'}: no such job "
                             "folder")):
        result = samples(str(folder))
        assert (result.exit_code, result.stderr.splitlines()) == (1, [message])


def test_long_text_is_shortened_and_escapes_are_shown_not_sent(clean_run: CleanRun,
                                                               tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(clean_run.path / SAMPLES_FILE, job / SAMPLES_FILE)
    planted = {**read_samples(job / SAMPLES_FILE, step=3)[0], "index": 8,
               "response": "\x1b[2J<b>hi</b>\nline two " + "x" * 2000 + " answer 42",
               "prompt": "<bos>system\nBe brief.\nuser\ncopy this="}
    append_samples(job / SAMPLES_FILE, [planted])
    result = samples(str(job))
    assert result.exit_code == 0 and "\x1b" not in result.stdout
    response = result.stdout.splitlines()[-2].removeprefix("  response  ")
    assert response.startswith("\\x1b[2J<b>hi</b>⏎line two xxx")
    assert response.endswith("xxx answer 42") and " characters] … " in response
    assert f"[{len(planted['response']) - sum(RESPONSE_CHARS):,} characters]" in response
    assert "  prompt    <bos>system⏎Be brief.⏎user⏎copy this=" in result.stdout
    assert "9 of 9" in result.stdout.splitlines()[0]
    full = samples(str(job), "--full").stdout
    assert "\x1b" not in full and "x" * 2000 + " answer 42" in full
    assert "<b>hi</b>\n            line two" in full  # later lines under the first


def test_through_the_controller_by_job_id(clean_run: CleanRun, tmp_path: Path) -> None:
    path = clean_run.path / SAMPLES_FILE
    settings = make_settings(tmp_path, allowed_roots=(clean_run.path,))
    config = json.loads((clean_run.path / CONFIG_FILE).read_text())
    with serve_in_thread(create_app(settings, backend=FakeBackend())) as url:
        job = httpx.post(f"{url}/api/jobs/register", json={
            "config": config, "output_dir": str(clean_run.path)}).json()
        result = samples(job["id"], "--url", url, "--step", "2", "--json")
        assert result.exit_code == 0, result.output
        assert json_lines(result.stdout) == read_samples(path, step=2, evaluation=False)
        local = samples(str(clean_run.path)).stdout.splitlines()
        remote = samples(job["id"], "--url", url).stdout.splitlines()
        assert remote[0] == f"job {job['id']}: training samples of step 3, 8 of 8; steps " \
                            "with samples: 0-3"
        assert remote[1:] == local[1:]
        missing = samples(job["id"], "--url", url, "--step", "7")
        assert (missing.exit_code, missing.stderr.splitlines()) == (1, [
            f"error: job {job['id']}: no training samples at step 7; steps with training "
            "samples: 0-3"])
        unknown = samples("nope", "--url", url)
        assert (unknown.exit_code, unknown.stderr.splitlines()) == (1, ["error 404: no job nope"])
