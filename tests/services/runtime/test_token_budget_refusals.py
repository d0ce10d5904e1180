"""A token budget past the model's context is refused where a user hands the config in,
naming the field and the numbers: ``tally validate`` (exit 2) and a REST submission (422,
nothing stored), on the demo model (tiny, context 256) whose context is known by name;
the default episode budget (the model's context) fits it as it is.
docs/environments.md's own example passes the same check as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout.problems import Problem
from services.cli import app
from tests.services.controller.fakes import DEMO, DEMO_OVERRIDES, api_client

ROOT = Path(__file__).resolve().parents[3]
ENV = "rollout.environment.class_path=rollout.environments.guess_number:GuessNumber"
OVER = "rollout.environment.max_total_tokens=512"
SAID = ("rollout.environment.max_total_tokens: 512 > the model's context 256, leaving no "
        "room for a prompt; set it below 256")
runner = CliRunner()


def test_validate_refuses_an_episode_budget_past_the_demo_models_context() -> None:
    result = runner.invoke(app, ["validate", str(ROOT / "configs" / "demo.yaml"),
                                 "--set", ENV, "--set", OVER])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == SAID
    for budget in ([], ["--set", "rollout.environment.max_total_tokens=128"]):
        fits = runner.invoke(app, ["validate", str(ROOT / "configs" / "demo.yaml"), "--set",
                                   ENV, *budget])  # the default: the model's context
        assert fits.exit_code == 0, fits.output


def test_a_rest_submission_past_the_context_is_422_naming_the_field(tmp_path: Path) -> None:
    api = api_client(tmp_path)
    response = api.post("/api/jobs", json={"config_yaml": DEMO,
                                           "overrides": [*DEMO_OVERRIDES, ENV, OVER]})
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    assert {"field": "rollout.environment.max_total_tokens",
            "message": SAID.split(": ", 1)[1]} in [
        {k: e[k] for k in ("field", "message")} for e in errors], errors
    assert api.get("/api/jobs").json()["total"] == 0
    api.ctl.reconciler.tick()
    assert api.backend.jobs == {}


def _block(text: str, language: str, holding: str) -> str:
    (block,) = [b for b in re.findall(rf"```{language}\n(.*?)```", text, re.S) if holding in b]
    return block


def test_the_environment_docs_example_fits_the_demo_model_as_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """my_envs.py and my-job.yaml exactly as docs/environments.md shows them, on the
    default model (tiny): validate says ok, so the job's context check passes too."""
    docs = (ROOT / "docs" / "environments.md").read_text()
    (tmp_path / "my_envs.py").write_text(_block(docs, "python", "class TwoSums"))
    (tmp_path / "my-job.yaml").write_text(_block(docs, "yaml", "my_envs:TwoSums"))
    (tmp_path / "sums.jsonl").write_text(json.dumps({"prompt": "sum 1", "label": "12,30"})
                                         + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # PYTHONPATH=. of the docs' command
    result = runner.invoke(app, ["validate", "my-job.yaml"])
    assert result.exit_code == 0, result.output + result.stderr
    assert "model tiny" in result.output
    # and its first observation fits the prompt budget the job's manager will use
    from my_envs import TwoSums  # type: ignore[import-not-found]

    from rollout.tiny import resolve_model_path
    from rollout.token_budget import model_context, prompt_budget
    from rollout.tokenizer import load_tokenizer
    from rollout.turns import TurnFormat
    from services.config.job import load_job_config

    config = load_job_config(tmp_path / "my-job.yaml", [])
    tokenizer = load_tokenizer(resolve_model_path("tiny"))
    observation = TwoSums(**config.rollout.environment.kwargs).reset({"label": "12,30"})
    first = TurnFormat(tokenizer, apply_chat_template=True).first(observation)
    assert 0 < len(first) <= prompt_budget(config.rollout, model_context("tiny"))


def test_a_session_sample_past_the_context_is_422_before_the_engine_is_touched() -> None:
    """TrainingSession.sample's own checks on a session of the tiny model (context 256,
    known by name): the refusal comes before any weight sync or generation, so the
    session's Ray parts are not needed to see it."""
    from types import SimpleNamespace

    from services.config.job import parse_job_config
    from services.sessions.requests import Sample
    from services.sessions.runtime import SessionError, TrainingSession

    session = SimpleNamespace(model_path="tiny", config=parse_job_config("", []),
                              vocab_size=100)  # rollout.sampling.max_new_tokens: 64
    for prompts, sampling, problem in [
        ([[5] * 10, [5] * 200], None,
         ("prompt_tokens[1]", "200 tokens + sampling.max_new_tokens 64 = 264 > the "
                              "model's context 256; shorten it to 192 tokens or lower "
                              "max_new_tokens")),
        ([[5] * 10], {"max_new_tokens": 300},
         ("sampling.max_new_tokens", "300 leaves no room for a prompt in the model's "
                                     "context 256")),
    ]:
        request = Sample.model_validate({"prompt_tokens": prompts, "sampling": sampling})
        with pytest.raises(SessionError) as refused:
            TrainingSession.sample(session, request)  # type: ignore[arg-type]
        assert (refused.value.status, refused.value.problems) == (422, [Problem(*problem)])
