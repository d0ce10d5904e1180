"""The layout verifier on real Ray actors and process groups: packed DP=2 and CP=2 give
the gradients and terms of padded DP=1 for every update of a rollout, mode and term (one update per
rollout and a planted error: tests/services/test_cli.py), and its tolerance judges a term
against its own scale."""

from __future__ import annotations

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.trainer.helpers import random_train_batch
from trainer.config import (
    AggregationConfig,
    LossConfig,
    ObjectiveConfig,
    OptimizerConfig,
    TrainerConfig,
)
from trainer.verify import Layout, TermResult, compare, perturbed, verify_layouts

MODES = ("sample_mean", "token_mean", "prompt_mean", "constant")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


CONFIG = TrainerConfig(loss=LossConfig(kl_coef=0.1, entropy_coef=0.01, old_log_probs="rollout"),
                       max_tokens_per_micro_batch=20)
OBJECTIVE = ObjectiveConfig.compose(AggregationConfig(), CONFIG.loss, 8, 0.7)


def test_every_update_of_a_rollout_matches_across_layouts(ray_cluster: None, tiny_model: str
                                                        ) -> None:
    """2 optimizer steps per rollout × 2 epochs: each update's J and ∇J (pg, KL, entropy,
    every mode) on its own mini-batch equal padded DP=1's under packed DP=2 and CP=2 with
    several rows per rank (some samples longer than a row), with the rollout's old
    log-probs and real steps in between."""
    from transformers import AutoConfig

    from trainer.mini_batches import rollout_updates

    rollout = random_train_batch(AutoConfig.from_pretrained(tiny_model).vocab_size,
                                 num_prompts=8, group_size=2, seed=3)
    updates = rollout_updates(rollout, samples_per_step=8, num_epochs=2, seed=0,
                              rollout_index=0)
    assert len(updates) == 4
    config = TrainerConfig(
        loss=LossConfig(kl_coef=0.1, entropy_coef=0.01), max_tokens_per_micro_batch=12,
        optimizer=OptimizerConfig(type="sgd", lr=0.5, grad_clip=None))
    rows = verify_layouts(config, OBJECTIVE, tiny_model, rollout,
                          [Layout(1, 1, packed=False), Layout(2, 1), Layout(1, 2)],
                          updates=updates)
    assert {(r.mode, r.update) for r in rows} == {(m, u) for m in MODES for u in range(4)}
    assert len(rows) == 2 * 4 * 4 * 3
    bad = [r for r in rows if not r.ok]
    assert not bad, bad[:3]
    assert max(r.grad_rel for r in rows) < 1e-9  # float64: rounding only


def test_tolerance_scales_with_the_terms_own_magnitude() -> None:
    grads = {"w": torch.tensor([1.0, -2.0])}
    zero_j = TermResult(value=1e-9, magnitude=0.5, gradients=grads)  # J = 0 up to rounding
    noisy = TermResult(value=3e-9, magnitude=0.5, gradients=grads)
    *_, ok = compare(zero_j, noisy, rtol=1e-7, atol=1e-7)
    assert ok  # a relative-only check would see a difference of 2.0 here
    doubled = TermResult(value=1e-9, magnitude=0.5, gradients={"w": torch.tensor([2.0, -2.0])})
    grad_abs, grad_rel, *_, ok = compare(zero_j, doubled, rtol=1e-7, atol=1e-7)
    assert not ok and grad_abs == 1.0 and grad_rel == 0.5


def test_perturbation_moves_the_policy_off_the_reference() -> None:
    state = {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(0)),
             "step": torch.tensor(3)}
    moved = perturbed(state)
    assert not torch.equal(moved["w"], state["w"])
    assert torch.equal(moved["step"], state["step"])
    assert torch.equal(perturbed(state)["w"], moved["w"])  # seeded: every layout the same


def test_layout_names_say_packed_or_padded() -> None:
    assert Layout.parse("dp2cp1") == Layout(2, 1)
    assert Layout.parse("dp1cp1-padded") == Layout(1, 1, packed=False)
    assert str(Layout.parse("DP1CP2-packed")) == "dp1cp2-packed"
    with pytest.raises(ValueError, match="dp1cp1-padded"):
        Layout.parse("dp1cp1-ragged")
