"""Reward part types by kind (rollout/reward_config.part_kind): one class per entry, each
behind rollout/reward_parts/base.RewardPart. Building a part imports nothing heavy and no
user code, so the controller may build parts to place and check them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.reward_config import part_kind
from rollout.reward_parts.base import RewardPart
from rollout.reward_parts.custom import CustomPart
from rollout.reward_parts.http import HttpPart
from rollout.reward_parts.judge import JudgePart
from rollout.reward_parts.model import ModelPart
from rollout.reward_parts.rules import RulePart

PART_TYPES: dict[str, type[RewardPart]] = {
    "rule": RulePart, "model": ModelPart, "judge": JudgePart, "class": CustomPart,
    "http": HttpPart}
"""Kind -> the part class built from a config of that kind."""


def build_parts(configs: list[Any]) -> list[RewardPart]:
    """``rollout.reward_parts`` as parts, in order."""
    return [PART_TYPES[part_kind(config)](config) for config in configs]


def reward_actor_bundles(configs: list[Any]) -> list[dict[str, float]]:
    """One bundle per reward actor in :func:`start_reward_actors`' order (``{}``: an
    actor that needs no resource)."""
    return [bundle for part in build_parts(configs) for bundle in part.actor_bundles()]


def start_reward_actors(configs: list[Any], resolve: Callable[[str], str],
                        placement: list[dict[str, Any]] | None = None
                        ) -> dict[str, list[Any]]:
    """Every part's actors, started (not waited for), by part name; ``placement``:
    per-actor Ray options in :func:`reward_actor_bundles`' order (missing ones: none);
    ``resolve``: a model name to its folder."""
    options = list(placement or [])
    actors: dict[str, list[Any]] = {}
    for part in build_parts(configs):
        num_actors = len(part.actor_bundles())
        if num_actors:
            mine, options = options[:num_actors], options[num_actors:]
            actors[part.name] = part.start_actors(
                resolve, mine + [{}] * (num_actors - len(mine)))
    return actors
