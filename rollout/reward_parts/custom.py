"""A user's own reward part (``type: custom`` with ``class_path``): a subclass of
:class:`CustomReward`, built in the job with the part's ``kwargs`` and called on each
shard in the manager's process, like TRL's batched reward functions::

    rollout.reward: {type: custom, class_path: "mymod:Exact", kwargs: {strip: true}}

    class Exact(CustomReward):
        def __init__(self, strip: bool = True) -> None:
            self.strip = strip

        def score(self, prompts, responses, labels, metadata):
            return [None if lb is None else float(r.strip() == lb.strip())
                    for r, lb in zip(responses, labels)]

A value is a finite float, or None where the sample cannot be scored (counted as
``reward/<name>/unscored``). The controller only locates ``class_path``
(rollout/plugins.locate_object); the job imports it (:func:`load_reward_class`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from rollout.plugins import load_subclass
from rollout.reward_config import CustomPartConfig
from rollout.reward_parts.base import PartScores, RewardPart, RewardShard
from rollout.rewards import RewardError


class CustomReward(ABC):
    """Subclass this for a reward of your own; ``__init__`` receives the part's
    ``kwargs``, and one instance scores every shard of the job."""

    @abstractmethod
    def score(self, prompts: list[Any], responses: list[str], labels: list[str | None],
              metadata: list[dict[str, Any]]) -> list[float | None]:
        """One value per response: a finite float, or None when it cannot be scored.
        ``prompts``: as the records hold them (text, or chat messages); ``labels``: the
        reference answers (None without one); ``metadata``: the records' other fields."""


def load_reward_class(path: str, field: str) -> type[CustomReward]:
    """The class ``path`` names, imported (in the job only), a CustomReward."""
    return load_subclass(path, field, CustomReward, "rollout.reward_parts",
                         "a custom reward part must (class MyReward(CustomReward), "
                         "docs/extending.md)")


class CustomPart(RewardPart):
    """The user's :class:`CustomReward`, scored in the manager's process."""

    config: CustomPartConfig
    count_names: ClassVar[tuple[str, ...]] = ("unscored",)

    def __init__(self, config: CustomPartConfig) -> None:
        super().__init__(config)
        self.reward: CustomReward | None = None

    def user_code(self) -> tuple[str, str] | None:
        return self.config.class_path, "class_path"

    def check_user_code(self, field: str) -> None:
        load_reward_class(self.config.class_path, field)

    def bind(self, actors: list[Any]) -> None:
        cls = load_reward_class(self.config.class_path, f"reward {self.name}: class_path")
        try:
            self.reward = cls(**self.config.kwargs)
        except TypeError as err:  # kwargs its constructor does not take
            raise RewardError(f"reward {self.name}: {self.config.class_path}"
                              f"(**kwargs) failed: {err}") from err

    def submit(self, shard: RewardShard) -> PartScores:
        assert self.reward is not None, "bind() first: it builds the user's class"
        values = list(self.reward.score(shard.raw_prompts, shard.responses, shard.labels,
                                        shard.metadata))
        if len(values) != len(shard):
            raise RewardError(f"reward {self.name}: {self.config.class_path}.score returned "
                              f"{len(values)} values for {len(shard)} responses")
        bad = [v for v in values if v is not None and not (
            isinstance(v, int | float) and math.isfinite(v))]
        if bad:
            raise RewardError(f"reward {self.name}: {self.config.class_path}.score returned "
                              f"{bad[0]!r}; each value is a finite float or None")
        return PartScores([None if v is None else float(v) for v in values],
                          counts={"unscored": sum(v is None for v in values)})

    def collect(self, handles: list[PartScores], update_stats: bool = True) -> PartScores:
        return sum(handles[1:], handles[0]) if handles else PartScores([])
