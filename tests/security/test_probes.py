"""Security probes on the real controller app (in-process, ``fastapi.testclient``; Ray is
the in-memory job server of tests/services/controller/fakes.py) and the session server's
own app: forged and cross-session tokens, a token after its session ended, an oversize
body. The probes that need a live session (a request id replayed with other content) run
in tests/services/sessions/test_sessions.py, on its shared sessions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.clients.training_split import merge_answers, split_data
from services.controller.auth import session_token
from services.controller.settings import Settings
from services.sessions.server import create_app as session_app
from tests.services.controller.fakes import api_client

SESSION = {"config": {"rollout": {"model": "tiny"}}}
STEP = {"adam": {"lr": 1e-3}}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def api(tmp_path: Path) -> TestClient:
    return api_client(tmp_path, api_token="k3y", session_start_timeout_s=0.5,
                      max_request_bytes=4096)


def test_forged_cross_session_and_ended_tokens_are_refused(api: TestClient) -> None:
    a = api.post("/api/sessions", json=SESSION, headers=bearer("k3y")).json()
    b = api.post("/api/sessions", json=SESSION, headers=bearer("k3y")).json()
    forged = [session_token("another-key", a["id"]),  # the right recipe, the wrong key
              a["token"][:-1] + ("0" if a["token"][-1] != "0" else "1"),  # one char off
              session_token("k3y", a["id"][:-1]), "", "Bearer"]
    url = f"/api/sessions/{a['id']}"
    for token in [*forged, b["token"]]:  # b's token on a: cross-session
        assert api.post(f"{url}/optim_step", json=STEP, headers=bearer(token)
                        ).status_code == 401, token
        assert api.get(url, headers=bearer(token)).status_code == 401, token
        assert api.delete(url, headers=bearer(token)).status_code == 401, token
    assert api.delete(url, headers=bearer(a["token"])).json()["status"] == "ended"
    replayed = api.post(f"{url}/optim_step", json=STEP, headers=bearer(a["token"]))
    assert replayed.status_code == 409 and "is ended" in replayed.json()["detail"]
    # b is untouched by every probe on a
    assert api.get(f"/api/sessions/{b['id']}", headers=bearer(b["token"])
                   ).json()["status"] == "starting"


def test_an_oversize_body_is_413_naming_the_setting_and_the_limit(api: TestClient) -> None:
    a = api.post("/api/sessions", json=SESSION, headers=bearer("k3y"))
    assert a.headers["x-tally-max-request-bytes"] == "4096"  # a client sizes its calls
    url = f"/api/sessions/{a.json()['id']}/forward_backward"
    big = json.dumps({"data": [{"tokens": [1] * 2000}]}).encode()
    headers = {**bearer(a.json()["token"]), "content-type": "application/json"}
    for content in (big, iter([big])):  # its length declared, or streamed without one
        response = api.post(url, content=content, headers=headers)
        assert response.status_code == 413, response.text
        body = response.json()
        assert (body["setting"], body["limit"]) == ("server.max_request_bytes", 4096)
        assert "server.max_request_bytes (TALLY_MAX_REQUEST_BYTES) is 4096" in body["detail"]


def test_the_limit_reads_its_new_and_old_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TALLY_MAX_BODY_BYTES", "2000")
    assert Settings.from_env().max_request_bytes == 2000  # the old name still works
    monkeypatch.setenv("TALLY_MAX_REQUEST_BYTES", "3000")
    assert Settings.from_env().max_request_bytes == 3000  # the new one wins
    assert Settings.from_env().max_body_bytes == 3000


def test_the_session_server_answers_only_the_controllers_secret() -> None:
    """No call reaches the session without its secret (the app is the real one; the
    session object is never reached, so none is built)."""
    app = TestClient(session_app(None, "the-secret", lambda *_: None))  # type: ignore[arg-type]
    for headers in ({}, bearer("the-secre"), bearer("the-secret "), bearer("THE-SECRET")):
        for verb in ("forward_backward", "optim_step", "close", "load"):
            response = app.post(f"/{verb}", json={}, headers=headers)
            assert response.status_code == 401, (verb, headers)
        assert app.get("/state", headers=headers).status_code == 401


def datum(size: int, group: int) -> dict:
    return {"tokens": [1] * size, "targets": [1] * size, "weights": [1.0] * size,
            "group": group}


def test_a_split_body_fits_keeps_groups_whole_and_merges_to_the_union() -> None:
    """split_data's parts fit the limit, hold whole prompt_mean groups and every datum
    once, in order; merge_answers' loss is Σ loss_k·D_k / Σ D_k (the union's J)."""
    data = [datum(40 + 7 * (i % 3), i // 4) for i in range(24)]
    body = {"data": data, "loss_fn": "ppo", "aggregation": {"mode": "prompt_mean"}}
    limit = 5000
    parts = split_data(body, limit)
    assert len(parts) > 2 and sorted(i for p in parts for i in p) == list(range(24))
    for part in parts:
        sent = {**body, "data": [data[i] for i in part], "request_id": "x" * 64}
        assert len(json.dumps(sent)) <= limit
        assert {i // 4 for i in part} == {data[i]["group"] for i in part}
        assert len(part) % 4 == 0  # whole groups
    answers = [{"loss": float(k + 1), "logprobs": [[float(i)] for i in part],
                "metrics": {"denominator": float(len(part) // 4), "valid_tokens": 10.0,
                            "pg_loss": 1.0, "kl": 0.0, "entropy": 0.0}}
               for k, part in enumerate(parts)]
    merged = merge_answers(answers, parts)
    total = sum(len(p) // 4 for p in parts)
    assert merged["loss"] == pytest.approx(sum((k + 1) * len(p) // 4
                                               for k, p in enumerate(parts)) / total)
    assert merged["logprobs"] == [[float(i)] for i in range(24)]
    assert merged["metrics"]["parts"] == len(parts)
    with pytest.raises(ValueError, match=r"data\[0\]: group 0 alone is"):
        split_data({**body, "data": [datum(500, 0)] * 4}, limit)
