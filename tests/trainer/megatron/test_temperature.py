"""Megatron at TP=2 on gloo processes (no Ray): the trainer's log-probs are those of the
engine's sampling distribution softmax(z / T), for the loss and as old log-probs. The
vocabulary spans both TP ranks (``helpers.WIDE_VOCAB``: real ids on rank 1 too); the
vocab-parallel terms themselves, at TP 2 and 3 in float64: test_vocab_parallel.py."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.trainer.helpers import sampled_train_batch
from tests.trainer.megatron.helpers import (
    create_wide_vocab_checkpoint,
    objective_for,
    start_worker,
)
from trainer.config import LossConfig, TrainerConfig
from trainer.step_plan import plan_step

pytest.importorskip("megatron.core")

TP = 2
CONFIG = TrainerConfig(backend="megatron", tp_size=TP, loss=LossConfig(old_log_probs="rollout"))


def _mismatch(rank: int, port: int, model_path: str, batch, temperatures: list[float]
              ) -> dict[str, object]:
    worker = start_worker(CONFIG, objective_for(CONFIG, temperatures[0]), model_path, rank,
                          port)
    mismatch = []
    for temperature in temperatures:
        objective = objective_for(CONFIG, temperature)
        plan = plan_step(batch, objective, 1, 1, CONFIG.max_tokens_per_micro_batch)
        (sums, _), = worker.gradients(batch, [plan], [objective])
        mismatch.append(sums["mismatch/log_prob_abs_diff"])
    # The old log-probs of a rollout with several updates: the log_probs verb at T.
    objective = objective_for(CONFIG, temperatures[0])
    worker.objective = objective
    plan = plan_step(batch, objective, 1, 1, CONFIG.max_tokens_per_micro_batch)
    old = worker.log_probs(batch, plan)
    old = old if old is not None else torch.zeros_like(batch.rollout_log_probs)
    worker.config = CONFIG.model_copy(update={"loss": LossConfig(old_log_probs="trainer")})
    (sums, _), = worker.gradients(batch.with_old_log_probs(old), [plan], [objective])
    return {"mismatch": mismatch, "old_log_probs": old, "ratio_dev": sums["ratio/mean_abs_dev"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    model_path = create_wide_vocab_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)
    batch = sampled_train_batch(model_path, temperature=0.7)
    ranks = run_ranks(_mismatch, TP, model_path, batch, [0.7, 1.0])
    ranks[0].update(rollout_log_probs=batch.rollout_log_probs, loss_mask=batch.loss_mask)
    return ranks


@pytest.mark.slow
def test_trainer_log_probs_match_the_engine_at_its_temperature(results: list[dict]) -> None:
    at_sampling, at_one = results[0]["mismatch"]
    assert at_sampling < 1e-5  # mean |log π_trainer − log π_engine| per token
    assert at_one > 1e-2  # a trainer that ignored T would be visibly off


def test_old_log_probs_are_the_engines_at_temperature_and_give_ratio_one(
        results: list[dict]) -> None:
    old, rollout = results[0]["old_log_probs"], results[0]["rollout_log_probs"]
    mask = results[0]["loss_mask"] > 0
    assert torch.allclose(old[mask], rollout[mask], atol=1e-4, rtol=0)
    assert (old[~mask] == 0).all()
    assert results[0]["ratio_dev"] < 1e-6  # the first update: ρ = 1
