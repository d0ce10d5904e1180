"""``tally_reward_model.json``: how a reward-model folder's scores are to be read, written
by ``tally train-rm`` beside the weights and read by the reward actors for their
defaults. Free of torch: preflight reads it too.

    {"chat_template": true, "max_length": 512, "truncation": "left", "base_model": …}

A job's ``type: model`` part that leaves ``chat_template`` or ``max_length`` unset takes
the file's; one that sets a different value is refused before anything starts, naming
the field (``rollout.reward[1].chat_template``): the reward trained on is the reward
served (rollout/reward_text.py). A folder without the file (a model from elsewhere) keeps
the part's own defaults: no template, the model's context.
"""

from __future__ import annotations

import json
from typing import Any

from rollout.confined import read_inside
from rollout.reward_config import RewardModelConfig

INFO_FILE = "tally_reward_model.json"
"""Its name in a reward-model folder."""
SETTINGS = ("chat_template", "max_length")
"""The settings a serving part must share with training."""


def read_reward_model_info(folder: str, field: str) -> dict[str, Any] | None:
    """The folder's settings (None: it has no such file); ValueError naming ``field`` when
    the file is not what train-rm writes."""
    try:
        raw = read_inside(folder, INFO_FILE, f"{field}.path", limit=1 << 20)
    except FileNotFoundError:
        return None
    try:
        info = json.loads(raw)
    except ValueError as err:
        raise ValueError(f"{field}.path: {folder}/{INFO_FILE} is not JSON ({err})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{field}.path: {folder}/{INFO_FILE} is not a JSON object")
    if "chat_template" in info and not isinstance(info["chat_template"], bool):
        raise ValueError(f"{field}.path: {folder}/{INFO_FILE}: chat_template is not a bool")
    length = info.get("max_length")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool)
                               or length < 1):
        raise ValueError(f"{field}.path: {folder}/{INFO_FILE}: max_length is not a "
                         "positive integer")
    return info


def served_config(config: RewardModelConfig, field: str = "rollout.reward"
                  ) -> RewardModelConfig:
    """``config`` with its unset settings taken from the folder's file (module docstring);
    ValueError naming ``{field}.<setting>`` when it contradicts the file."""
    info = read_reward_model_info(config.path, field) or {}
    update: dict[str, Any] = {}
    for name in SETTINGS:
        if name not in info or info[name] is None:
            continue
        mine = getattr(config, name)
        if mine is None:
            update[name] = info[name]
        elif mine != info[name]:
            raise ValueError(
                f"{field}.{name}: {mine!r}, but {config.path} was trained with {name} "
                f"{info[name]!r} ({INFO_FILE}); leave it unset or give the same value: "
                "a reward model scores what it was trained on")
    if config.chat_template is None and "chat_template" not in update:
        update["chat_template"] = False
    return config.model_copy(update=update) if update else config
