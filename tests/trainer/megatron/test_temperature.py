"""Megatron at TP=2 on gloo processes (no Ray): the trainer's log-probs are those of the
engine's sampling distribution softmax(z / T), and the vocab-parallel log-probs and
entropy equal the full-vocabulary ones, finite with −inf logits, values and gradients.
The vocabulary spans both TP ranks (``helpers.WIDE_VOCAB``: real ids on rank 1 too)."""

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
from trainer.losses import log_probs_and_entropy
from trainer.step_plan import plan_step

pytest.importorskip("megatron.core")

TP = 2
CONFIG = TrainerConfig(backend="megatron", tp_size=TP, loss=LossConfig(old_log_probs="rollout"))


def _vocab_parallel_case(worker, temperature: float) -> dict[str, torch.Tensor]:
    """This rank's slice of shared random logits (some −inf) through the vocab-parallel
    path: log-probs, entropy and the gradient of each's sum w.r.t. the logits."""
    from trainer.backends.megatron.loss import vocab_parallel_log_probs

    shape = worker.shape
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(2, 5, shape.padded_vocab_size, generator=gen) * 3
    full[0, 1, : shape.vocab_size - 1] = -torch.inf  # one finite logit left in the row
    full[1, :, 100:160] = -torch.inf  # blocked tokens on both ranks (rank 1 from 128)
    targets = torch.randint(0, shape.vocab_size, (2, 5), generator=gen)
    targets[0, 1] = shape.vocab_size - 1
    start = worker.weights.tp_rank * shape.vocab_per_rank
    local = full[..., start: start + shape.vocab_per_rank].clone().requires_grad_(True)
    log_probs, entropy = vocab_parallel_log_probs(local, targets, shape, temperature,
                                                  entropy=True)
    (log_prob_grad,) = torch.autograd.grad(log_probs.sum(), local, retain_graph=True)
    (entropy_grad,) = torch.autograd.grad(entropy.sum(), local)
    return {"full": full[..., : shape.vocab_size], "targets": targets,
            "log_probs": log_probs.detach(), "entropy": entropy.detach(),
            "log_prob_grad": log_prob_grad, "entropy_grad": entropy_grad}


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
    return {"mismatch": mismatch, "vocab_parallel": _vocab_parallel_case(worker, 0.7),
            "old_log_probs": old, "ratio_dev": sums["ratio/mean_abs_dev"]}


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


def _full_vocabulary_case(results: list[dict]
                          ) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rank 0's case, its full logits as a leaf, their full-vocabulary log-probs and
    entropy)."""
    case = results[0]["vocab_parallel"]
    full = case["full"].clone().requires_grad_(True)
    log_probs, entropy = log_probs_and_entropy(full, case["targets"], 0.7,
                                               with_entropy_grad=True)
    return case, full, log_probs, entropy


def _vocab_parallel_grads(results: list[dict], name: str, vocab_size: int) -> torch.Tensor:
    """Every rank's gradient slice put back together, over the real vocabulary."""
    grads = torch.cat([r["vocab_parallel"][name] for r in results], dim=-1)
    assert torch.isfinite(grads).all()
    return grads[..., :vocab_size]


def test_vocab_parallel_terms_equal_full_vocabulary_and_stay_finite(results: list[dict]
                                                                   ) -> None:
    case, full, log_probs, entropy = _full_vocabulary_case(results)
    assert torch.allclose(case["log_probs"], log_probs.detach(), atol=1e-5, rtol=0)
    assert torch.allclose(case["entropy"], entropy.detach(), atol=1e-5, rtol=0)
    assert case["entropy"][0, 1].abs() < 1e-6  # one token left: H = 0, not NaN
    (expected,) = torch.autograd.grad(log_probs.sum(), full)
    grads = _vocab_parallel_grads(results, "log_prob_grad", full.shape[-1])
    assert torch.allclose(grads, expected, atol=1e-5, rtol=0)
    _vocab_parallel_grads(results, "entropy_grad", full.shape[-1])  # finite


def test_vocab_parallel_entropy_gradient_equals_full_vocabulary(results: list[dict]) -> None:
    _, full, _, entropy = _full_vocabulary_case(results)
    (expected,) = torch.autograd.grad(entropy.sum(), full)
    grads = _vocab_parallel_grads(results, "entropy_grad", full.shape[-1])
    assert torch.allclose(grads, expected, atol=1e-5, rtol=0)


def test_old_log_probs_are_the_engines_at_temperature_and_give_ratio_one(
        results: list[dict]) -> None:
    old, rollout = results[0]["old_log_probs"], results[0]["rollout_log_probs"]
    mask = results[0]["loss_mask"] > 0
    assert torch.allclose(old[mask], rollout[mask], atol=1e-4, rtol=0)
    assert (old[~mask] == 0).all()
    assert results[0]["ratio_dev"] < 1e-6  # the first update: ρ = 1
