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


@pytest.fixture(scope="session")
def eos_prone_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with its EOS embedding turned towards the mean last hidden state, so
    EOS is sampled ~10% of the time (seed 0's is ~1%): uneven response lengths without
    stop strings (what partial rollouts need to show a long tail)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = create_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "eos_prone", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(3, model.config.vocab_size, (16, 24),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        direction = hidden.mean(dim=(0, 1))
        model.get_input_embeddings().weight[model.config.eos_token_id] = (
            1.5 * direction / direction.norm())
    model.save_pretrained(path, safe_serialization=True)
    return path
