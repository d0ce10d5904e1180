"""One ``Problem(field, message)`` type from the config rules to the 422, and one 422
body: every refusal of the controller (a config, a request FastAPI checks, a parameter a
route checks) and of a session's server lists its problems the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rollout.problems import Problem
from services.config.errors import ConfigError
from services.config.job import ConfigProblem, load_job_config
from services.controller.problems import unprocessable
from services.controller.schemas import ValidationErrorOut
from tests.services.controller.fakes import DEMO, DEMO_OVERRIDES, api_client


def test_the_422_builder_lists_each_field_and_says_them_in_one_line() -> None:
    response = unprocessable([Problem("rollout.global_batch_size", "must be > 0"),
                              Problem("<config>", "nested deeper than 32 levels")],
                             prefix="config: ")
    assert response.status_code == 422
    body = json.loads(response.body)
    assert body == {
        "detail": "config: rollout.global_batch_size: must be > 0; <config>: nested deeper "
                  "than 32 levels",
        "errors": [{"field": "rollout.global_batch_size", "message": "must be > 0"},
                   {"field": "<config>", "message": "nested deeper than 32 levels"}]}
    assert ValidationErrorOut.model_validate(body).model_dump() == body  # the schema's shape
    told = json.loads(unprocessable([Problem("a", "x")], detail="said otherwise").body)
    assert told["detail"] == "said otherwise" and told["errors"] == [
        {"field": "a", "message": "x"}]


def test_a_config_rule_names_its_field_as_a_problem() -> None:
    assert ConfigProblem is Problem  # the config rules' problems are the one type
    assert Problem.from_rule("divisor: must be > 0", "aggregation") == Problem(
        "aggregation.divisor", "must be > 0")
    assert Problem.from_rule("no field here", "trainer") == Problem("trainer", "no field here")
    with pytest.raises(ConfigError) as info:
        load_job_config(Path("configs/demo.yaml"), ["rollout.global_batch_size=0"])
    assert [type(p) for p in info.value.problems] == [Problem]
    assert info.value.problems[0].field == "rollout.global_batch_size"


@pytest.fixture
def api(tmp_path: Path) -> TestClient:
    return api_client(tmp_path)


def test_every_controller_refusal_has_the_one_body(api: TestClient) -> None:
    config = api.post("/api/jobs", json={"config_yaml": DEMO,
                                         "overrides": ["rollout.global_batch_size=0"]})
    request = api.post("/api/jobs", json={"config_yaml": DEMO, "overrides": "not a list"})
    fastapi_checked = api.post("/api/sessions", json={"bogus": 1})  # FastAPI's own check
    key = api.post("/api/jobs", json={"config_yaml": DEMO}, headers={"Idempotency-Key": ""})
    job = api.post("/api/jobs", json={"config_yaml": DEMO, "overrides": DEMO_OVERRIDES}).json()
    beyond = api.post(f"/api/jobs/{job['id']}/metrics", json={"rows": [
        {"step": 50, "metrics": {"kl": 0.0}}]})
    for response in (config, request, fastapi_checked, key, beyond):
        assert response.status_code == 422, response.text
        body = response.json()
        assert set(body) == {"detail", "errors"} and body["errors"], body
        assert body["detail"].endswith("; ".join(
            f"{e['field']}: {e['message']}" for e in body["errors"])), body
    assert config.json()["errors"][0]["field"] == "rollout.global_batch_size"
    assert request.json()["errors"][0]["field"] == "overrides"
    assert [e["field"] for e in fastapi_checked.json()["errors"]] == ["body.bogus"]
    assert key.json()["detail"] == "Idempotency-Key: 1 to 200 characters"
    assert beyond.json()["errors"] == [{"field": "rows[0].step", "message": (
        "50 is beyond the job's steps 0..1")}]


def test_a_sessions_refusal_is_the_same_body_and_says_if_it_may_be_sent_again() -> None:
    from services.sessions.server import problems_response

    response = problems_response(409, [Problem("optim_step", "no forward_backward call")],
                                 retriable=True)
    assert response.status_code == 409
    assert json.loads(response.body) == {
        "detail": "optim_step: no forward_backward call", "retriable": True,
        "errors": [{"field": "optim_step", "message": "no forward_backward call"}]}
