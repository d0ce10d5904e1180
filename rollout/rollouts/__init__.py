"""The one rollout interface (base.py) and its implementations: single-turn prompts
(single_turn.py) and an environment's episodes (episodic.py); the one evaluation path
(evaluation.py) and a step's batch (step.py) on top of it."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from rollout.config import RolloutConfig
from rollout.reward_parts import Rewarder
from rollout.rollouts.base import (
    Generate,
    Play,
    Played,
    Request,
    Rollout,
    Sample,
    ShardsAsDone,
    StepStats,
)
from rollout.rollouts.episodic import Episodic
from rollout.rollouts.evaluation import EvalOutcome, EvalRun, evaluate
from rollout.rollouts.single_turn import SingleTurn
from rollout.turns import TurnFormat

__all__ = [
    "Episodic",
    "EvalOutcome",
    "EvalRun",
    "Play",
    "Played",
    "Request",
    "Rollout",
    "Sample",
    "SingleTurn",
    "StepStats",
    "build_rollout",
    "evaluate",
]


def build_rollout(config: RolloutConfig, rewarder: Rewarder, turns: TurnFormat | None,
                  tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int, context: int | None,
                  generate: Generate, shards_as_done: ShardsAsDone) -> Rollout:
    """Episodes of rollout.environment when there is one (``turns`` its format), else
    single-turn responses scored by rollout.reward."""
    if config.environment is None:
        return SingleTurn(tokenizer, rewarder, shards_as_done)
    assert turns is not None
    return Episodic(config.environment, turns, generate, max_prompt_tokens,
                    config.prompt_truncation, context)
