"""Fixtures of the rollout tests: one tiny checkpoint per session (two seeds), and its
turn format for the episode tests."""

from __future__ import annotations

import pytest

from rollout.tiny import create_tiny_checkpoint
from rollout.tokenizer import load_tokenizer
from rollout.turns import TurnFormat


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with seed 0 (the weights every engine starts from)."""
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


@pytest.fixture(scope="session")
def other_tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with seed 1: different weights, same shapes."""
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed1", seed=1)


@pytest.fixture(scope="module")
def turns(tiny_model_path: str) -> TurnFormat:
    """The tiny model's turns, no chat template (tests/rollout/episode_play.py)."""
    return TurnFormat(load_tokenizer(tiny_model_path), apply_chat_template=False)
