"""What a page on another site (or a rebound DNS name) could make a browser send, against a
real controller on loopback (uvicorn, SQLite; Ray faked): refused before any route runs,
and bounded parsing of what is accepted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.controller.app import create_app
from services.controller.settings import Settings
from services.controller.submission import text_depth
from tests.services.controller.fakes import (
    DEMO,
    DEMO_OVERRIDES,
    FakeBackend,
    make_settings,
    serve_in_thread,
)


def serve(tmp_path: Path, **settings: object) -> Iterator[tuple[str, httpx.Client]]:
    app = create_app(make_settings(tmp_path, **settings), backend=FakeBackend())
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield url, http


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, httpx.Client]]:
    yield from serve(tmp_path, public_url="https://tally.example.org")


def submit(http: httpx.Client, *overrides: str, **kwargs) -> httpx.Response:
    return http.post("/api/jobs", json={"config_yaml": DEMO,
                                        "overrides": [*DEMO_OVERRIDES, *overrides]}, **kwargs)


def count_jobs(http: httpx.Client) -> int:
    return http.get("/api/jobs").json()["total"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_form_content_types_are_415_and_queue_nothing(server, content_type: str) -> None:
    _, http = server
    response = http.post("/api/jobs", content=DEMO, headers={"Content-Type": content_type})
    assert response.status_code == 415, response.text
    assert count_jobs(http) == 0


def test_a_form_post_cannot_cancel(server) -> None:
    _, http = server
    job = submit(http).json()
    response = http.post(f"/api/jobs/{job['id']}/cancel", content=b"x=1",
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 415
    assert http.get(f"/api/jobs/{job['id']}").json()["status"] in ("queued", "pending")
    assert http.post(f"/api/jobs/{job['id']}/cancel").json()["status"] == "cancelled"


def test_cross_site_origin_is_403_same_origin_passes(server) -> None:
    url, http = server
    assert submit(http, headers={"Origin": "http://evil.example"}).status_code == 403
    assert submit(http, headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert submit(http, headers={"Origin": "null"}).status_code == 403
    assert count_jobs(http) == 0
    assert submit(http, headers={"Origin": url}).status_code == 201
    assert submit(http, headers={"Origin": "https://tally.example.org"}).status_code == 201
    assert http.get("/api/jobs", headers={"Origin": "http://evil.example"}).status_code == 200


def test_foreign_host_is_421(server) -> None:
    url, http = server
    port = url.rsplit(":", 1)[1]
    for host in ("evil.example", f"rebind.attacker.test:{port}", ""):
        response = http.get("/api/jobs", headers={"Host": host})
        assert response.status_code == 421, (host, response.text)
    assert submit(http, headers={"Host": f"evil.example:{port}"}).status_code == 421
    assert count_jobs(http) == 0
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}",
                 "tally.example.org"):
        assert http.get("/healthz", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TALLY_ALLOWED_HOSTS", "a.example, b.example")
    assert Settings.from_env().allowed_hosts == ("a.example", "b.example")


def test_a_65_kb_config_is_413_before_parsing(server) -> None:
    _, http = server
    big = DEMO + "#" + "x" * (65 * 1024) + "\n"
    assert submit(http).status_code == 201
    response = http.post("/api/jobs", json={"config_yaml": big})
    assert response.status_code == 413 and "at most 65536" in response.text
    response = http.post("/api/jobs", content=big, headers={"Content-Type": "application/yaml"})
    assert response.status_code == 413
    response = http.post("/api/sweeps", json={"config_yaml": big, "modes": ["token_mean"]})
    assert response.status_code == 413
    response = http.post("/api/jobs", json={"config": {"name": "x", "pad": "y" * 70_000}})
    assert response.status_code == 413
    huge = http.post("/api/jobs", content=b"{" + b" " * 200_000 + b"}",
                     headers={"Content-Type": "application/json"})
    assert huge.status_code == 413  # the body, before JSON parsing
    assert count_jobs(http) == 1


@pytest.mark.parametrize("size", [100_000, 60_000])
def test_nested_bracket_bodies_are_refused_before_the_yaml_parser_sees_them(
        server, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """A bracket bomb is refused by the size check (413) or the linear depth scan (422):
    the YAML parser, whose cost on such input is what the limits guard against, never
    sees it (the submission is parsed on the event loop)."""
    from services.controller import submission

    parsed: list[str] = []

    def spy(text: str, *args, **kwargs):
        parsed.append(text)
        return load_yaml(text, *args, **kwargs)

    load_yaml = submission.load_yaml
    monkeypatch.setattr(submission, "load_yaml", spy)
    _, http = server
    bomb = "a: " + "[" * (size // 2) + "]" * (size // 2)
    for request in (lambda: http.post("/api/jobs", json={"config_yaml": bomb}),
                    lambda: http.post("/api/jobs", content=bomb,
                                      headers={"Content-Type": "application/yaml"}),
                    lambda: http.post("/api/sweeps", json={"config_yaml": bomb,
                                                           "modes": ["token_mean"]})):
        response = request()
        assert response.status_code == (413 if size > 65536 else 422), response.text
    assert parsed == []
    deep = {"name": "x"}
    for _ in range(100):
        deep = {"a": deep}
    response = http.post("/api/jobs", json={"config": deep})
    assert response.status_code == 422 and "nested deeper than 32" in response.text
    assert submit(http).status_code == 201 and parsed == [DEMO]  # the spy does see configs


def test_depth_counts_blocks_lists_and_flow_but_not_quotes_or_comments() -> None:
    assert text_depth(DEMO) <= 4
    assert text_depth("a:\n  b:\n    c: [1, {d: [2]}]\n") == 6
    assert text_depth("a: '[[[['\nb: \"{{{{\" # [[[[\n") == 1
    assert text_depth("- - - - x\n") == 5  # the line, and four sequences in it



def test_metric_reads_are_capped(server, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.controller import views
    from tests.services.controller.fakes import step_rows

    _, http = server
    job = submit(http, "num_steps=1500").json()
    rows = step_rows(1500)
    for start in range(0, len(rows), 500):
        http.post(f"/api/jobs/{job['id']}/metrics", json={"rows": rows[start:start + 500]})
    url = f"/api/jobs/{job['id']}/metrics"
    too_many = ",".join(f"m{i}" for i in range(201))
    assert http.get(url, params={"names": too_many}).status_code == 422
    bogus = http.get(url, params={"names": ",".join(f"nope/{i:03d}" for i in range(200)),
                                  "max_points": 100_000})
    assert bogus.status_code == 200 and bogus.json()["series"] == {}
    assert len(bogus.content) < 20_000  # no 200 columns of nulls
    monkeypatch.setattr(views, "MAX_CELLS", 3000)
    every = http.get(url, params={"max_points": 100_000}).json()
    assert every["downsampled"] and len(every["steps"]) * len(every["series"]) <= 3000
    assert every["steps"][0] == 0 and every["steps"][-1] == 1499
