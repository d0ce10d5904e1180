"""User code runs only in jobs: the real app (tests/services/controller_fakes.api_client, a
real SQLite store, Ray's job server in memory) checks a submitted ``module:attr`` without
importing it, and refuses a class_path that is no environment, naming the field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.services.controller.fakes import DEMO, DEMO_OVERRIDES, api_client

MARKING = """from pathlib import Path
Path({marker!r}).write_text("imported")  # module top-level code: runs only where imported


def score(prompt, response, label):
    return 0.0
"""


def test_submit_runs_none_of_a_user_modules_code(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward module whose import writes a marker file is accepted at submit (it is on
    the path and defines the function) and leaves no marker: located, never imported."""
    code, marker = tmp_path / "code", tmp_path / "imported.txt"
    (code / "marking_pkg").mkdir(parents=True)
    (code / "marking_pkg" / "__init__.py").write_text(MARKING.format(marker=str(marker)))
    (code / "marking_pkg" / "rewards.py").write_text(MARKING.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(code))
    api = api_client(tmp_path)
    for path in ("marking_pkg:score", "marking_pkg.rewards:score"):
        response = api.post("/api/jobs", json={"config_yaml": DEMO, "overrides": [
            *DEMO_OVERRIDES, "rollout.reward.type=custom",
            f"rollout.reward.custom_function={path}"]})
        assert response.status_code == 201, response.text
        assert not marker.exists(), path
        assert "marking_pkg" not in sys.modules and "marking_pkg.rewards" not in sys.modules


@pytest.mark.parametrize("class_path", ["subprocess:Popen", "os:system",
                                        "tests.rollout.reward_fns:length_reward"])
def test_a_class_path_that_is_no_environment_is_refused_naming_the_field(
        tmp_path: Path, class_path: str) -> None:
    """``subprocess:Popen`` with ``kwargs: {args: ..., shell: true}`` would run a shell
    command in the job: a standard-library module, or a function, is never an
    environment."""
    api = api_client(tmp_path)
    response = api.post("/api/jobs", json={"config_yaml": DEMO, "overrides": [
        *DEMO_OVERRIDES, f"rollout.environment.class_path={class_path}",
        "rollout.environment.kwargs={args: 'touch /tmp/pwned', shell: true}",
        "rollout.environment.max_total_tokens=64"]})
    assert response.status_code == 422, response.text
    fields = {error["field"] for error in response.json()["errors"]}
    assert fields == {"rollout.environment.class_path"}, response.json()["errors"]
    assert api.get("/api/jobs").json()["total"] == 0
