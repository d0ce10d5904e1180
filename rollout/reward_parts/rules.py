"""Rules (``exact_match``, ``numeric``, ``boxed``) and a user's function (``type: custom``
with ``custom_function``), scored in the manager's process (rollout/rewards.py)."""

from __future__ import annotations

from rollout.plugins import check_object
from rollout.reward_config import RewardConfig
from rollout.reward_parts.base import PartScores, RewardPart, RewardShard
from rollout.rewards import RewardScorer, check_error_rate


class RulePart(RewardPart):
    """A batched function of (responses, labels, metadata); a sample whose function
    raises gets ``default_on_error`` and counts against ``max_error_rate``."""

    config: RewardConfig

    def __init__(self, config: RewardConfig) -> None:
        super().__init__(config)
        self._scorer: RewardScorer | None = None  # built by bind: it may import user code

    def user_code(self) -> tuple[str, str] | None:
        path = self.config.custom_function
        return None if path is None else (path, "custom_function")

    def check_user_code(self, field: str) -> None:
        if self.config.custom_function is not None:
            check_object(self.config.custom_function, field)

    def bind(self, actors: list[object]) -> None:
        self._scorer = RewardScorer(self.config)

    def submit(self, shard: RewardShard) -> PartScores:
        assert self._scorer is not None, "bind() first: it loads the function"
        result = self._scorer.score(shard.responses, shard.labels, shard.metadata)
        return PartScores(list(result.rewards), num_errors=result.num_errors,
                          first_error=result.first_error)

    def collect(self, handles: list[PartScores], update_stats: bool = True) -> PartScores:
        return sum(handles[1:], handles[0]) if handles else PartScores([])

    def check_errors(self, num_errors: int, first_error: str | None, num_samples: int,
                     step: int) -> None:
        check_error_rate(num_errors, num_samples, self.config, step, first_error)
