"""Episodes of tests/rollout/toy_envs.py played on an in-process engine, as the manager
plays them (tests/rollout/test_episodes.py, test_prefix_cache.py)."""

from __future__ import annotations

import hashlib

from rollout.config import EnvironmentConfig, SamplingConfig
from rollout.engines.base import EpisodeTurn, Generation
from rollout.engines.torch_engine import TorchEngine
from rollout.episodes import Episode, run_episodes
from rollout.turns import TurnFormat

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6, stop=["a", "e"])
TOYS = "tests.rollout.toy_envs"


def play(engine: TorchEngine, turns: TurnFormat, labels: list[str], env: str,
         seed: int = 0, context: int | None = None,
         calls: list[tuple[int, int]] | None = None, say_turns: bool = False,
         **settings: object) -> tuple[list[Episode], float]:
    """(episodes, environment seconds) of one prompt per label in ``env``. ``calls``:
    gets (longest context, max_new_tokens) of each engine call; ``say_turns``: each call
    says its EpisodeTurn (what lets the torch engine keep KV across turns)."""
    config = EnvironmentConfig.model_validate({"class_path": f"{TOYS}:{env}", **settings})

    def generate(contexts: list[list[int]], max_new_tokens: int, turn: int
                 ) -> list[Generation]:
        if calls is not None:
            calls.append((max(len(c) for c in contexts), max_new_tokens))
        turn_seed = int.from_bytes(hashlib.sha256(f"{seed}:{turn}".encode()).digest()[:4])
        said = EpisodeTurn("play", turn, turn + 1 == config.max_turns) if say_turns else None
        return engine.generate(contexts, SAMPLING.model_copy(
            update={"max_new_tokens": max_new_tokens}), turn_seed, turn=said)

    return run_episodes([{"prompt": "p", "label": label, "metadata": {}} for label in labels],
                        config, turns, generate, SAMPLING.max_new_tokens,
                        lambda ids, i: ids, context)
