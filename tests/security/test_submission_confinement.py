"""Confinement of the paths a REST job names, on the real controller app: every field
the schema marks as a path (rollout/config_paths.py) resolves inside the allowed roots
or is refused naming the roots, never what the folder holds; a name that is no folder
here (a Hugging Face hub id) is refused at once, never looked up; a job's own folder is
never an allowed root or a folder the controller keeps. And the marks stay complete: a
str field whose name looks like a path is marked or listed here as not one."""

from __future__ import annotations

import os
import re
import time
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from rollout.config_paths import marked_paths, path_kind
from services.config.job import JobConfig
from services.train_rm.config import RewardModelConfig as TrainRmConfig
from tests.services.controller.fakes import api_client

OUTSIDE = "/etc"
"""A folder outside every root that holds something (its listing must never be said)."""
GAE = {"advantage": {"type": "gae"}}


@pytest.fixture
def api(tmp_path: Path) -> TestClient:
    shared = tmp_path / "shared"
    shared.mkdir()
    return api_client(tmp_path, allowed_roots=(shared,))


def submit(api: TestClient, config: dict[str, Any]) -> Any:
    return api.post("/api/jobs", json={"config": config})


@pytest.mark.parametrize(("config", "field"), [
    ({"critic": {"enabled": True, "model": OUTSIDE}, "rollout": GAE}, "critic.model"),
    ({"rollout": {"teacher": {"model": OUTSIDE}}}, "rollout.teacher.model"),
    ({"rollout": {"advantage": {"type": "distill", "teacher": OUTSIDE}}},
     "rollout.advantage.teacher"),
    ({"rollout": {"reward": {"type": "model", "path": OUTSIDE}}}, "rollout.reward.path"),
    ({"rollout": {"reward": [{"type": "boxed"}, {"type": "model", "path": "rm",
                                                 "tokenizer": OUTSIDE}]}},
     "rollout.reward[1].tokenizer"),
    ({"rollout": {"reward": [{"type": "boxed"}, {"type": "judge", "model": OUTSIDE}]}},
     "rollout.reward[1].model"),
    ({"rollout": {"tokenizer": OUTSIDE}}, "rollout.tokenizer"),
], ids=["critic", "teacher", "distill-teacher", "reward-model", "rm-tokenizer", "judge",
        "tokenizer"])
def test_every_marked_path_outside_the_roots_is_422_naming_the_roots_only(
        api: TestClient, config: dict[str, Any], field: str) -> None:
    if field == "rollout.reward[1].tokenizer":  # its path must pass to reach the tokenizer
        (api.ctl.settings.data_dir / "rm").mkdir(parents=True)
    response = submit(api, config)
    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    roots = ", ".join(str(r) for r in api.ctl.settings.roots)
    assert error == {"field": field, "message": (
        f"{OUTSIDE} is outside the allowed roots ({roots}); move it into one, or start the "
        f"controller with its folder in TALLY_ALLOWED_ROOTS ('{os.pathsep}'-separated)")}
    listed = set(os.listdir(OUTSIDE))
    assert not listed & set(re.findall(r"[\w.-]+", response.text)), response.text
    assert api.get("/api/jobs").json()["total"] == 0


@pytest.mark.parametrize(("config", "field"), [
    ({"rollout": {"model": "someorg/somemodel"}}, "rollout.model"),
    ({"critic": {"enabled": True, "model": "someorg/critic"}, "rollout": GAE}, "critic.model"),
    ({"rollout": {"reward": {"type": "model", "path": "someorg/rm"}}}, "rollout.reward.path"),
    ({"rollout": {"reward": [{"type": "judge", "model": "someorg/judge"}]}},
     "rollout.reward[0].model"),
], ids=["policy", "critic", "reward-model", "judge"])
def test_a_hub_style_name_is_422_naming_the_field_at_once(
        api: TestClient, config: dict[str, Any], field: str) -> None:
    """``org/name`` is no folder in the data folder: refused as such, before anything
    could take it for a hub id (offline, a lookup blocks for most of a minute)."""
    started = time.monotonic()
    response = submit(api, config)
    elapsed = time.monotonic() - started
    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    assert error["field"] == field and "Tally does not download" in error["message"], error
    assert elapsed < 5, f"{elapsed:.1f} s: something looked the name up"


def test_built_in_model_names_stay_allowed(api: TestClient) -> None:
    config = {"critic": {"enabled": True, "model": "tiny"}, "rollout": GAE}
    response = submit(api, config)
    assert response.status_code == 201, response.text
    assert response.json()["config_resolved"]["critic"]["model"] == "tiny"


def test_a_local_folder_is_written_back_absolute(api: TestClient) -> None:
    rm = api.ctl.settings.roots[1] / "rm"
    rm.mkdir()
    config = {"rollout": {"reward": [{"type": "boxed"}, {"type": "model", "path": str(rm)}]}}
    response = submit(api, config)
    # The folder holds no model: preflight says so of the same field, after confinement.
    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    assert error["field"] == "rollout.reward[1].path", error
    assert "outside" not in error["message"] and "download" not in error["message"], error


@pytest.mark.parametrize("which", ["root", "data", "sessions", "above-root"])
def test_output_dir_is_never_a_root_or_a_controller_folder(api: TestClient,
                                                           which: str) -> None:
    """``DELETE ?folder=true`` removes a job's folder: it must hold nothing but the job."""
    settings = api.ctl.settings
    folder = {"root": settings.roots[1], "data": settings.data_dir,
              "sessions": settings.sessions_dir / "x",
              "above-root": settings.roots[1].parent}[which]
    response = submit(api, {"output_dir": str(folder)})
    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    assert error["field"] == "output_dir", error


PATH_LIKE = re.compile(r"model|path|tokenizer|dir|file|dataset")
NOT_PATHS = {
    "CustomPartConfig.class_path": "module:Class of a reward part, imported in the job "
                                   "(rollout/reward_parts/custom.py), not opened",
    "EnvironmentConfig.class_path": "module:attr, imported (rollout/plugins.py), not opened",
    "AdvantageConfig.class_path": "module:attr, imported (rollout/plugins.py), not opened",
    "LossConfig.class_path": "module:attr, imported (rollout/plugins.py), not opened",
    "JudgeConfig.server_model": "the model name a remote judge server is asked for (the "
                                "request's \"model\"), never opened here",
}
"""Fields whose names look like paths but are not: each says what it is instead."""


def _models(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models(arg)


def _names_str(annotation: Any) -> bool:
    if annotation is str:
        return True
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, typing.Annotated, list, tuple):
        return any(_names_str(arg) for arg in typing.get_args(annotation))
    return False


def _all_models(*roots: type[BaseModel]) -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    todo = list(roots)
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.append(model)
        for info in model.model_fields.values():
            todo.extend(_models(info.annotation))
    return seen


def test_every_path_like_str_field_is_marked_or_listed_as_not_a_path() -> None:
    models = _all_models(JobConfig, TrainRmConfig)
    assert len(models) > 20  # the walk reached the nested sections and union variants
    unmarked = [f"{model.__name__}.{name}" for model in models
                for name, info in model.model_fields.items()
                if PATH_LIKE.search(name) and _names_str(info.annotation)
                and path_kind(info) is None
                and f"{model.__name__}.{name}" not in NOT_PATHS]
    assert not unmarked, (
        f"{unmarked}: mark each with json_schema_extra=MODEL/FOLDER/FILE/OUTPUT "
        "(rollout/config_paths.py) so the controller confines it, or list it in NOT_PATHS")


def test_the_walk_finds_marks_in_nested_lists_and_union_variants() -> None:
    config = JobConfig.model_validate({
        "rollout": {"dataset": {"type": "jsonl", "path": "d.jsonl"}, "reward": [
            {"type": "boxed"}, {"type": "model", "path": "rm"}, {"type": "judge"}]},
        "eval": {"dataset": "held.jsonl"}, "output_dir": "out"})
    assert list(marked_paths(config)) == [
        ("rollout.model", "model", "tiny"), ("rollout.dataset.path", "file", "d.jsonl"),
        ("rollout.reward[1].path", "folder", "rm"),
        ("rollout.reward[2].model", "model", "smollm2-135m-instruct"),
        ("eval.dataset", "file", "held.jsonl"), ("output_dir", "output", "out")]
