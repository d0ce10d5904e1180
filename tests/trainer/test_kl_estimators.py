"""Each KL estimator (trainer/losses/kl.py) is the math its table says (docs/loss-aggregation.md,
"The KL estimators"): exact sums over a small vocabulary in float64, no sampling. For random
logits θ and a fixed reference, the expected value Σ_y π(y) k(y) and the expected gradient
of k as a loss term, Σ_y sg(π(y)) ∇θ k(y) (y ~ π, the sampling not differentiated), are
computed with autograd through the production ``kl_penalty``; and the config refuses, as a
loss term, the estimators whose expected gradient is not the reverse KL's."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from trainer.config import LossConfig
from trainer.losses import kl_penalty

VOCAB = 7
SEEDS = range(5)
TOLERANCE = 1e-10


def _policy_and_reference(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits θ (a leaf, float64) and a fixed reference distribution's log-probs."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=gen, dtype=torch.float64).requires_grad_()
    ref_log_probs = torch.log_softmax(
        torch.linspace(-1.0, 1.5, VOCAB, dtype=torch.float64), dim=0)
    return logits, ref_log_probs


def expected_value_and_gradient(estimator: str, seed: int) -> tuple[float, torch.Tensor]:
    """Σ_y π(y) k(y) and Σ_y sg(π(y)) ∇θ k(y), every token of the vocabulary one sample."""
    logits, ref_log_probs = _policy_and_reference(seed)
    log_probs = torch.log_softmax(logits, dim=0)
    k = kl_penalty(log_probs, ref_log_probs, estimator, torch.ones(VOCAB, dtype=torch.float64))
    expected = (log_probs.exp().detach() * k).sum()
    (gradient,) = torch.autograd.grad(expected, logits)
    return expected.item(), gradient


def reverse_kl_and_gradient(seed: int) -> tuple[float, torch.Tensor]:
    """KL(π‖ref) = Σ π log(π/ref) and its gradient in θ, by autograd of the formula."""
    logits, ref_log_probs = _policy_and_reference(seed)
    log_probs = torch.log_softmax(logits, dim=0)
    kl = (log_probs.exp() * (log_probs - ref_log_probs)).sum()
    (gradient,) = torch.autograd.grad(kl, logits)
    return kl.item(), gradient


def forward_kl_gradient(seed: int) -> torch.Tensor:
    """∇θ KL(ref‖π) = ∇θ Σ ref log(ref/π), by autograd of the formula."""
    logits, ref_log_probs = _policy_and_reference(seed)
    log_probs = torch.log_softmax(logits, dim=0)
    kl = (ref_log_probs.exp() * (ref_log_probs - log_probs)).sum()
    (gradient,) = torch.autograd.grad(kl, logits)
    return gradient


def descends_reverse_kl(estimator: str, seed: int) -> bool:
    """The check: the estimator's expected gradient is ∇KL(π‖ref) to TOLERANCE."""
    gradient = expected_value_and_gradient(estimator, seed)[1]
    return (gradient - reverse_kl_and_gradient(seed)[1]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["k2", "k3+"])
def test_k2_and_k3_plus_have_the_reverse_kl_gradient(estimator: str, seed: int) -> None:
    assert descends_reverse_kl(estimator, seed)
    assert expected_value_and_gradient(estimator, seed)[1].abs().max() > 1e-3  # not vacuous


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["k3"])  # low_var_kl too, while no token's k3 > 10
def test_k3_has_the_forward_kl_gradient(estimator: str, seed: int) -> None:
    gradient = expected_value_and_gradient(estimator, seed)[1]
    assert (gradient - forward_kl_gradient(seed)).abs().max() < TOLERANCE


@pytest.mark.parametrize("seed", SEEDS)
def test_k1_has_zero_expected_gradient(seed: int) -> None:
    assert expected_value_and_gradient("k1", seed)[1].abs().max() < TOLERANCE


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["k1", "k3", "k3+"])
def test_unbiased_estimators_expect_the_reverse_kl(estimator: str, seed: int) -> None:
    value = expected_value_and_gradient(estimator, seed)[0]
    assert value == pytest.approx(reverse_kl_and_gradient(seed)[0], abs=TOLERANCE)


@pytest.mark.parametrize("seed", SEEDS)
def test_k2_expects_half_the_mean_squared_log_ratio_not_the_kl(seed: int) -> None:
    """E_π[k2] = ½ Σ π log²(π/ref): KL's second-order approximation, close but not equal."""
    logits, ref_log_probs = _policy_and_reference(seed)
    log_probs = torch.log_softmax(logits.detach(), dim=0)
    half_square = 0.5 * (log_probs.exp() * (log_probs - ref_log_probs).square()).sum().item()
    value, kl = expected_value_and_gradient("k2", seed)[0], reverse_kl_and_gradient(seed)[0]
    assert value == pytest.approx(half_square, abs=TOLERANCE)
    assert abs(value - kl) > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
def test_the_gradient_check_fails_on_a_planted_error(seed: int) -> None:
    """Computing with k3 (or k1) where k3+ is expected fails the reverse-KL comparison."""
    assert descends_reverse_kl("k3+", seed)
    assert not descends_reverse_kl("k3", seed)
    assert not descends_reverse_kl("k1", seed)
    k3, k3_plus = (expected_value_and_gradient(e, seed)[1] for e in ("k3", "k3+"))
    relative = (k3 - k3_plus).norm() / k3_plus.norm()
    assert relative > 0.1, relative  # not a rounding difference


def test_k3_plus_is_k3_in_value_and_k2_in_gradient_per_token() -> None:
    log_probs = torch.tensor([-0.3, -2.0, -1.1], dtype=torch.float64, requires_grad=True)
    ref, mask = torch.tensor([-1.0, -0.5, -1.1], dtype=torch.float64), torch.ones(3)
    value = kl_penalty(log_probs, ref, "k3+", mask)
    assert torch.equal(value, kl_penalty(log_probs, ref, "k3", mask))
    (k3_plus,) = torch.autograd.grad(value.sum(), log_probs)
    (k2,) = torch.autograd.grad(kl_penalty(log_probs, ref, "k2", mask).sum(), log_probs)
    assert torch.equal(k3_plus, k2)


@pytest.mark.parametrize(("estimator", "reason"), [
    ("k1", "expected gradient 0"), ("k3", "forward KL"), ("low_var_kl", "forward KL")])
def test_a_loss_term_that_does_not_descend_the_reverse_kl_is_refused(estimator: str,
                                                                     reason: str) -> None:
    with pytest.raises(ValidationError, match=f"kl_estimator: {estimator} .*{reason}"):
        LossConfig(kl_coef=0.1, kl_estimator=estimator)


def test_k1_is_refused_as_a_loss_even_with_the_flag() -> None:
    with pytest.raises(ValidationError, match="kl_estimator: k1 "):
        LossConfig(kl_coef=0.1, kl_estimator="k1", allow_biased_kl_gradient=True)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl", "k3+"])
def test_the_rest_is_accepted(estimator: str) -> None:
    assert LossConfig(kl_estimator=estimator).kl_coef == 0  # no KL term: nothing is a loss
    if estimator != "k1":
        LossConfig(kl_coef=0.1, kl_estimator=estimator, allow_biased_kl_gradient=True)
    if estimator in ("k2", "k3+"):
        LossConfig(kl_coef=0.1, kl_estimator=estimator)
    assert LossConfig(kl_coef=0.1).kl_estimator == "k3+"  # the default is a loss as is
