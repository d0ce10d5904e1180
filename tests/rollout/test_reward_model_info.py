"""A reward model is served as it was trained: the reward actor takes its unset settings
from the folder's tally_reward_model.json (what train-rm writes), preflight refuses a
job that contradicts the file naming the field, and over-long texts are cut (or refused)
by ``truncation`` and counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.reward_config import RewardModelConfig
from rollout.reward_model_info import INFO_FILE, served_config
from rollout.tiny import resolve_model_path
from services.config.job import ConfigError, parse_job_config
from services.runtime.preflight import preflight
from tests.reward_model_folders import save_random_reward_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random RM folder with the settings file train-rm writes."""
    folder = save_random_reward_model(tmp_path_factory.mktemp("rm") / "rm",
                                      resolve_model_path("tiny"), seed=3)
    (Path(folder) / INFO_FILE).write_text(json.dumps(
        {"chat_template": True, "max_length": 24, "base_model": "tiny"}))
    return folder


def test_unset_settings_come_from_the_file(trained: str, tmp_path: Path) -> None:
    served = served_config(RewardModelConfig(path=trained))
    assert (served.chat_template, served.max_length) == (True, 24)
    same = served_config(RewardModelConfig(path=trained, chat_template=True, max_length=24))
    assert (same.chat_template, same.max_length) == (True, 24)
    bare = save_random_reward_model(tmp_path / "bare", resolve_model_path("tiny"))
    plain = served_config(RewardModelConfig(path=bare))  # no file: the part's defaults
    assert (plain.chat_template, plain.max_length) == (False, None)


def test_a_contradiction_is_refused_naming_the_field(trained: str) -> None:
    with pytest.raises(ValueError, match=r"^rollout\.reward\[1\]\.chat_template: False, but "):
        served_config(RewardModelConfig(path=trained, chat_template=False),
                      "rollout.reward[1]")
    with pytest.raises(ValueError, match=r"^rollout\.reward\.max_length: 512, but .* "
                                         r"max_length 24 \(tally_reward_model\.json\)"):
        served_config(RewardModelConfig(path=trained, max_length=512))


def test_preflight_refuses_a_job_that_contradicts_the_file(trained: str) -> None:
    rule = {"type": "exact_match"}

    def job(part: dict) -> object:
        return parse_job_config(json.dumps({"rollout": {"reward": [rule, part]}}))

    with pytest.raises(ConfigError) as info:
        preflight(job({"type": "model", "path": trained, "chat_template": False}))
    assert len(info.value.problems) == 1
    assert str(info.value).startswith("rollout.reward[1].chat_template: False, but ")
    preflight(job({"type": "model", "path": trained}))  # unset: the file's, passes
    preflight(job({"type": "model", "path": trained, "chat_template": True}))


def test_the_actor_cuts_or_refuses_long_texts_and_counts_them(trained: str) -> None:
    from rollout.reward_model import RewardModel

    long_prompt, short = "x" * 40, "2+2="
    actor = RewardModel(RewardModelConfig(path=trained, dtype="float32"))
    assert actor.chat_template and actor.max_length == 24  # from the file
    ids, over = actor.input_ids([long_prompt, short], ["4", "4"])
    bos = actor.tokenizer.bos_token_id
    assert over == 1 and len(ids[0]) == 24 and ids[0][0] == bos and ids[0][1] != bos
    scores, _, counted = actor.score([long_prompt, short], ["4", "4"])
    assert counted == 1 and all(isinstance(s, float) for s in scores)
    refusing = RewardModel(RewardModelConfig(path=trained, dtype="float32",
                                             truncation="refuse"))
    refused, _, counted = refusing.score([long_prompt, short], ["4", "4"])
    assert counted == 1 and refused[0] is None and refused[1] == pytest.approx(scores[1], abs=1e-5)
    right = RewardModel(RewardModelConfig(path=trained, dtype="float32", truncation="right"))
    ids, over = right.input_ids([long_prompt], ["4"])
    assert over == 1 and ids[0] == actor.tokenizer.apply_chat_template(
        [{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "4"}],
        tokenize=True)["input_ids"][:24]
