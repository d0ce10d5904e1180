"""Reward actors batch by tokens (issue 52): rows sorted by length, each batch's rows ×
its longest row under ``max_tokens_per_batch``, scores back in the samples' order; a
batch that runs out of memory is halved and tried again, down to one row. Held to
transformers' forward of each text alone (no batch, no padding), both in float64 (in
float32 the two paths' kernels differ by ~1e-6 already for one row alone).

The out-of-memory path is driven by a test double for the GPU allocator: the model's
decoder wrapped so that a forward of more than ``k`` rows raises
``torch.OutOfMemoryError`` (what CUDA's allocator raises: torch.cuda.OutOfMemoryError is
one), the rest of the actor's code running as in a job."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rollout.reward_config import RewardModelConfig
from rollout.reward_model import RewardModel, RewardModelOOM, token_batches
from tests.reward_model_folders import save_random_reward_model

WORDS = ["the", "sum", "of", "seven", "and", "twelve", "is", "nineteen", "carry", "one"]


def _texts(seed: int, num_texts: int) -> tuple[list[str], list[str]]:
    """Prompts and responses of mixed lengths (a few tokens to ~70)."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choices(WORDS, k=rng.choice([1, 2, 5, 20, 40])))
               for _ in range(num_texts)]
    responses = [" ".join(rng.choices(WORDS, k=rng.randint(0, 25))) for _ in prompts]
    return prompts, responses


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: str) -> str:
    return save_random_reward_model(tmp_path_factory.mktemp("rm") / "rm", tiny_model_path,
                                    seed=5)


@pytest.fixture(scope="module")
def alone(rm_folder: str) -> Callable[[list[int]], float]:
    """transformers' score of ``ids`` alone: one row, no pad token in its config, so it
    reads the last id itself."""
    model = AutoModelForSequenceClassification.from_pretrained(rm_folder,
                                                               dtype=torch.float64).eval()
    model.config.pad_token_id = None

    def score(ids: list[int]) -> float:
        with torch.no_grad():
            return float(model(input_ids=torch.tensor([ids])).logits[0, 0])
    return score


def _recording(actor: RewardModel, max_rows: int | None = None) -> list[tuple[int, int]]:
    """The actor's model in float64 and its decoder wrapped: each forward's (rows,
    width) recorded; with ``max_rows``, a forward of more rows raises
    torch.OutOfMemoryError first."""
    actor.model.to(torch.float64)
    decoder = actor.model.base_model
    forward = decoder.forward
    shapes: list[tuple[int, int]] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        rows, width = kwargs["input_ids"].shape
        if max_rows is not None and rows > max_rows:
            raise torch.OutOfMemoryError(f"test double: {rows} rows > {max_rows}")
        shapes.append((rows, width))
        return forward(*args, **kwargs)

    decoder.forward = wrapped
    return shapes


def test_token_batches_cover_each_row_once_under_the_budget() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 30))]
        budget = rng.choice([1, 30, 64, 100, 500])
        rows = rng.choice([None, 1, 3])
        batches = token_batches(lengths, budget, rows)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        order = [lengths[i] for b in batches for i in b]
        assert order == sorted(lengths, reverse=True)  # longest first: little padding
        for batch in batches:
            padded = len(batch) * max(lengths[i] for i in batch)
            assert padded <= budget or len(batch) == 1
            assert rows is None or len(batch) <= rows
        # greedy: no batch could have taken the next batch's first row
        for b in batches[:-1]:
            fits = (len(b) + 1) * lengths[b[0]] <= budget
            assert not fits or (rows is not None and len(b) == rows)


@pytest.mark.parametrize("budget", [1, 60, 150, 400, 100_000])
def test_scores_are_each_text_scored_alone(rm_folder: str, alone: Callable[[list[int]],
                                                                            float],
                                           budget: int) -> None:
    prompts, responses = _texts(budget, 17)
    actor = RewardModel(RewardModelConfig(path=rm_folder, dtype="float32",
                                          max_tokens_per_batch=budget))
    shapes = _recording(actor)
    ids, _ = actor.input_ids(prompts, responses)
    lengths = [len(row or ()) for row in ids]
    assert len(set(lengths)) > 5 and max(lengths) > 60  # mixed lengths
    scores, _, truncated, retries = actor.score_shard(prompts, responses)
    assert (truncated, retries) == (0, 0)
    assert scores == [pytest.approx(alone(row or []), abs=1e-6) for row in ids]
    assert sum(rows for rows, _ in shapes) == len(prompts)
    assert all(rows * width <= budget or rows == 1 for rows, width in shapes)
    if budget >= sum(lengths) * 2:  # everything fits: one forward
        assert len(shapes) == 1
    if budget == 1:
        assert len(shapes) == len(prompts)


@pytest.mark.parametrize("max_rows", [1, 2, 3])
def test_an_out_of_memory_batch_is_halved_and_scores_stay(
        rm_folder: str, alone: Callable[[list[int]], float], max_rows: int) -> None:
    prompts, responses = _texts(7, 12)
    config = RewardModelConfig(path=rm_folder, dtype="float32", max_tokens_per_batch=10**6)
    actor = RewardModel(config)
    shapes = _recording(actor, max_rows=max_rows)
    ids, _ = actor.input_ids(prompts, responses)
    scores, _, _, retries = actor.score_shard(prompts, responses)
    assert scores == [pytest.approx(alone(row or []), abs=1e-6) for row in ids]
    # one batch of 12 rows halved down: 12 → 6+6 → 3+3 (+3+3) → …
    halvings = {1: 1 + 2 + 4 + 4, 2: 1 + 2 + 4, 3: 1 + 2}[max_rows]
    assert retries == halvings
    assert sum(rows for rows, _ in shapes) == len(prompts)
    assert max(rows for rows, _ in shapes) <= max_rows
    assert actor.score(prompts, responses)[0] == scores  # score(): the same, 3 fields


def test_one_row_that_does_not_fit_raises_naming_the_part(rm_folder: str) -> None:
    actor = RewardModel(RewardModelConfig(path=rm_folder, name="judge_rm",
                                          dtype="float32"))
    _recording(actor, max_rows=0)
    with pytest.raises(RewardModelOOM, match=r"reward judge_rm: one text of \d+ tokens"):
        actor.score_shard(["a question"], ["an answer"])


def test_batch_size_caps_rows_on_top_of_tokens(rm_folder: str) -> None:
    prompts, responses = _texts(3, 9)
    actor = RewardModel(RewardModelConfig(path=rm_folder, dtype="float32", batch_size=2,
                                          max_tokens_per_batch=10**6))
    shapes = _recording(actor)
    actor.score_shard(prompts, responses)
    assert [rows for rows, _ in shapes] == [2, 2, 2, 2, 1]


def test_the_budget_is_a_positive_int() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        RewardModelConfig(path=str(Path("rm")), max_tokens_per_batch=0)
