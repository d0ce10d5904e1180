"""A user's own reward part (``type: custom`` with ``class_path``): located at submit
without running it, imported and checked for its base class in the job's preflight, and,
in a tiny real job, the same training as the built-in it rewrites.

The built-in's run is the session's clean run (tests/services/driver/clean_run.py, built
once per ``make test``; configs/demo.yaml's reward is ``exact_match``): a tiny job's cost is
its gang's start (its steps take a tenth of a second), so the comparison starts one gang,
not two."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config.job import ConfigError, parse_job_config
from services.runtime.preflight import preflight
from tests.services.driver.clean_run import CleanRun, assert_same_training, clean_config

CUSTOM = ["rollout.reward.type=custom"]
FIELD = "rollout.reward.class_path"


def _problem(overrides: list[str], load: bool) -> str:
    with pytest.raises(ConfigError) as info:
        preflight(parse_job_config("", overrides), load_user_code=load)
    assert len(info.value.problems) == 1, str(info.value)
    return str(info.value)


def test_class_path_is_located_at_submit_and_checked_in_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "imported"
    (tmp_path / "marking_rewards.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "class Mine:\n    def score(self, *args):\n        return []\n")
    assert _problem([*CUSTOM, f"{FIELD}=missing_rewards:Mine"], load=False).startswith(
        f"{FIELD}: cannot import module 'missing_rewards'")
    located = [*CUSTOM, f"{FIELD}=marking_rewards:Mine"]
    assert preflight(parse_job_config("", located)) == []  # the controller: not run
    assert not marker.exists()
    assert _problem(located, load=True) == (  # the job: imported, and not a CustomReward
        f"{FIELD}: marking_rewards:Mine is a class that does not subclass "
        "rollout.reward_parts.CustomReward; a custom reward part must "
        "(class MyReward(CustomReward), docs/extending.md)")
    assert marker.exists()
    listed = ["rollout.reward=[{type: exact_match}, {type: custom, name: mine, "
              "class_path: tests.rollout.reward_classes:a_function}]"]
    assert _problem(listed, load=True).startswith(
        "rollout.reward[1].class_path: tests.rollout.reward_classes:a_function is a function")
    good = ["rollout.reward=[{type: exact_match}, {type: custom, name: mine, "
            "class_path: tests.rollout.reward_classes:ShortFor, kwargs: {limit: 3}}]"]
    assert preflight(parse_job_config("", good), load_user_code=True) == []


@pytest.mark.slow  # one tiny job on Ray (and the session's clean job)
@pytest.mark.usefixtures("warm_gang_pool")
def test_a_custom_exact_match_trains_as_the_built_in_one(clean_run: CleanRun,
                                                         tmp_path: Path) -> None:
    from services.driver.loop import run_job
    from services.driver.samples import read_samples
    from services.driver.sinks import read_metrics

    assert clean_config().rollout.reward.type == "exact_match"  # the built-in rewritten
    custom = tmp_path / "custom"
    run_job(clean_config("rollout.reward={type: custom, name: exact_match, "
                         "class_path: 'tests.rollout.reward_classes:ExactMatch'}"),
            custom, log=lambda *_: None)

    rows = read_metrics(custom / "metrics.jsonl")
    assert [r["metrics"]["reward/exact_match/unscored"] for r in rows] == [0.0] * 4
    assert any(r["metrics"]["reward/exact_match/mean"] > 0 for r in rows)  # not all 0
    assert_same_training(custom, clean_run, ignore=("reward/exact_match/unscored",))
    assert read_samples(custom / "samples.jsonl") == read_samples(clean_run.path /
                                                                  "samples.jsonl")
