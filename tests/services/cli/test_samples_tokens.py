"""``tally samples JOB --tokens``: each training sample's response token by token, read
from a samples.jsonl the driver's own code wrote (services/driver/sample_tokens.py on a
multi-turn batch, the float64 reference standing for the trainer), in its folder and
through a controller over real HTTP: every printed number is the record's (to the digits
shown), the gap is trainer − engine, observations are marked, a token's terminal escape
is shown, never sent."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from rollout.tiny import create_tiny_checkpoint
from services.cli import app
from services.cli.samples import TOKEN_CHARS
from services.controller.app import create_app
from services.driver.run_dir import SAMPLES_FILE
from services.driver.sample_tokens import logged_samples
from services.driver.samples import append_samples, read_samples
from tests.services.controller.fakes import FakeBackend, make_settings, serve_in_thread
from tests.services.driver.clean_run import clean_config
from tests.services.driver.test_sample_tokens import ReferenceTrainer, batch_of, samples

runner = CliRunner()
ESCAPE = "\x1b[2J"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job folder whose step 0 logs samples 3 (an episode: two observation tokens)
    and 4 with their tokens, the first token's text planted with a terminal escape, and
    one sample without tokens."""
    model = create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)
    batch = batch_of(samples())
    records = logged_samples(batch, ReferenceTrainer(model), sample_tokens=True)
    first = records[0].tokens
    records[0] = dataclasses.replace(records[0], tokens=dataclasses.replace(
        first, text=[ESCAPE, *first.text[1:]]))
    bare = dataclasses.replace(records[1], index=5, tokens=None)
    folder = tmp_path_factory.mktemp("job")
    append_samples(folder / SAMPLES_FILE, [*records, bare])
    return folder


def table(lines: list[str], start: int) -> list[dict]:
    """The token rows after the header at ``lines[start]``: fixed-width columns."""
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("  ") or not line[2:7].strip().isdigit():
            break
        numbers = line[9 + TOKEN_CHARS:].split()
        rows.append({"pos": int(line[2:7]), "token": line[9:9 + TOKEN_CHARS].rstrip(),
                     "numbers": [None if n == "–" else float(n) for n in numbers[:5]],
                     "obs": numbers[5:] == ["obs"]})
    return rows


def assert_table_is_the_records(output: str, rows: list[dict]) -> None:
    lines = output.splitlines()
    headers = [k for k, line in enumerate(lines) if line.split()[:2] == ["pos", "token"]]
    training = [r for r in rows if r.get("tokens")]
    assert len(headers) == len(training) == 2
    for start, row in zip(headers, training, strict=True):
        shown, tokens = table(lines, start), row["tokens"]
        assert [r["pos"] for r in shown] == list(range(row["response_tokens"]))
        assert [r["obs"] for r in shown] == tokens["observation"]
        for r, t in zip(shown, range(len(shown)), strict=True):
            advantage, engine, trainer, gap, entropy = r["numbers"][:5]
            want_engine, want_trainer = tokens["engine_log_prob"][t], tokens["trainer_log_prob"][t]
            assert advantage == pytest.approx(tokens["advantage"][t], abs=5e-4)
            for got, want in ((engine, want_engine), (trainer, want_trainer),
                              (entropy, tokens["entropy"][t])):
                assert (got is None) == (want is None)
                assert got is None or got == pytest.approx(want, abs=5e-5)
            if want_engine is None:
                assert gap is None
            else:
                assert gap == pytest.approx(want_trainer - want_engine,
                                            rel=1e-2, abs=1e-9)  # 3 digits shown
            assert r["token"] in (repr(tokens["text"][t]), "'\\x1b[2J'")
    assert "\x1b" not in output
    assert table(lines, headers[0])[0]["token"] == "'\\x1b[2J'"  # shown, not sent
    assert "  tokens    not recorded (logging.sample_tokens was off" in output


def test_a_job_folder_prints_each_sample_token_by_token(job: Path) -> None:
    rows = read_samples(job / SAMPLES_FILE)
    assert sum(r["tokens"]["observation"].count(True) for r in rows if "tokens" in r) == 2
    result = runner.invoke(app, ["samples", str(job), "--tokens"])
    assert result.exit_code == 0, result.output
    assert_table_is_the_records(result.stdout, rows)
    plain = runner.invoke(app, ["samples", str(job)])
    assert plain.exit_code == 0 and "entropy" not in plain.stdout  # asked for only
    as_json = runner.invoke(app, ["samples", str(job), "--json"])
    assert [json.loads(line) for line in as_json.stdout.splitlines()] == rows


def test_through_the_controller_the_same_table(job: Path, tmp_path: Path) -> None:
    settings = make_settings(tmp_path, allowed_roots=(job,))
    config = clean_config().model_dump(mode="json")
    with serve_in_thread(create_app(settings, backend=FakeBackend())) as url:
        registered = httpx.post(f"{url}/api/jobs/register", json={
            "config": config, "output_dir": str(job)}).json()
        remote = runner.invoke(app, ["samples", registered["id"], "--url", url, "--tokens"])
        assert remote.exit_code == 0, remote.output
        local = runner.invoke(app, ["samples", str(job), "--tokens"])
        assert remote.stdout.splitlines()[1:] == local.stdout.splitlines()[1:]
        as_json = runner.invoke(app, ["samples", registered["id"], "--url", url, "--json"])
        assert [json.loads(line) for line in as_json.stdout.splitlines()] == \
            read_samples(job / SAMPLES_FILE)

