from __future__ import annotations

import math

import pytest
import torch

from trainer.config import LossConfig
from trainer.losses import (
    entropy_from_logits,
    kl_penalty,
    log_probs_and_entropy,
    policy_gradient_loss,
    token_log_probs,
)

ONE = torch.ones(1)


def test_ppo_clip_takes_the_pessimistic_branch() -> None:
    log_ratio = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))
    advantages = torch.tensor([1.0, -1.0, 1.0, 1.0])
    terms = policy_gradient_loss(log_ratio, torch.zeros(4), advantages, LossConfig(eps_clip=0.2),
                                 torch.ones(4))
    # A>0, ρ=1.5: max(-1.5, -1.2) = -1.2 (clipped); A<0, ρ=0.5: max(0.5, 0.8) = 0.8 (clipped)
    # A>0, ρ=1.1: inside the range; A>0, ρ=0.7: max(-0.7, -0.8) = -0.7 (not clipped)
    assert terms.pg_loss.tolist() == pytest.approx([-1.2, 0.8, -1.1, -0.7])
    assert terms.clipped.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_clip_higher_and_dual_clip() -> None:
    log_ratio = torch.log(torch.tensor([1.5, 5.0]))
    advantages = torch.tensor([1.0, -1.0])
    config = LossConfig(eps_clip=0.2, eps_clip_high=0.28, dual_clip_c=3.0)
    terms = policy_gradient_loss(log_ratio, torch.zeros(2), advantages, config, torch.ones(2))
    # ρ=1.5 clipped at 1.28; ρ=5 with A<0: max(5, 1.2)=5, dual clip bounds it at c=3.
    assert terms.pg_loss.tolist() == pytest.approx([-1.28, 3.0])


def test_truncated_importance_sampling_weight() -> None:
    log_probs = torch.log(torch.tensor([0.5, 0.5]))
    rollout = torch.log(torch.tensor([0.25, 0.4]))  # π_trainer/π_rollout = 2 and 1.25
    config = LossConfig(tis_cap=1.5)
    terms = policy_gradient_loss(log_probs, log_probs, torch.ones(2), config, torch.ones(2),
                                 rollout)
    assert terms.pg_loss.tolist() == pytest.approx([-1.5, -1.25])


def test_kl_estimators() -> None:
    log_probs, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    delta = math.log(0.25) - math.log(0.5)
    assert kl_penalty(log_probs, ref, "k1", ONE).item() == pytest.approx(-delta)
    assert kl_penalty(log_probs, ref, "k2", ONE).item() == pytest.approx(0.5 * delta**2)
    k3 = math.exp(delta) - 1 - delta
    assert kl_penalty(log_probs, ref, "k3", ONE).item() == pytest.approx(k3)
    big = kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "low_var_kl", ONE)
    assert big.item() == 10.0


def test_entropy_of_uniform_is_log_vocab() -> None:
    entropy = entropy_from_logits(torch.zeros(2, 3, 7))
    assert entropy.flatten().tolist() == pytest.approx([math.log(7)] * 6)


def test_masked_overflow_gives_finite_gradients_everywhere() -> None:
    """Masked positions hold garbage log-probs (ref − logp ≫ 88.7, exp overflows in fp32);
    an unmasked one sits just past the clamp. Every term and every gradient stays finite
    (a where() applied after the exp() would back-propagate 0·inf = NaN)."""
    log_probs = torch.tensor([[-200.0, -1.0, -120.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.2, 0.0, -150.0]])
    old = torch.tensor([[0.0, -1.1, 0.0, -0.4]])
    rollout = torch.tensor([[0.0, -1.0, 0.0, -90.0]])
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    config = LossConfig(tis_cap=2.0, dual_clip_c=3.0)
    for estimator in ("k1", "k2", "k3", "low_var_kl", "k3+"):
        kl = kl_penalty(log_probs, ref, estimator, mask)
        pg = policy_gradient_loss(log_probs, old, -torch.ones(1, 4), config, mask, rollout)
        (kl.sum() + pg.pg_loss.sum()).backward()
        assert torch.isfinite(kl).all() and torch.isfinite(pg.pg_loss).all(), estimator
        assert torch.isfinite(log_probs.grad).all(), estimator
        assert (log_probs.grad[mask == 0] == 0).all(), estimator  # nothing leaks
        assert kl[mask == 0].eq(0).all() and pg.pg_loss[mask == 0].eq(0).all()
        log_probs.grad = None


def test_entropy_ignores_minus_inf_logits() -> None:
    logits = torch.tensor([[0.0, 0.0, -torch.inf]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    entropy.sum().backward()
    assert entropy.item() == pytest.approx(math.log(2))
    assert torch.isfinite(logits.grad).all()


def test_temperature_divides_the_logits() -> None:
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(token_log_probs(logits, targets, 0.7), expected)
    assert not torch.allclose(token_log_probs(logits, targets, 1.0), expected)
    log_probs, entropy = log_probs_and_entropy(logits, targets, 0.7, with_entropy_grad=False)
    assert torch.allclose(log_probs, expected)
    assert torch.allclose(entropy, entropy_from_logits(logits / 0.7))
    # bf16 logits are promoted: the log-probs come out in fp32.
    assert token_log_probs(logits.bfloat16(), targets, 0.7).dtype == torch.float32


def test_logits_at_the_loss_positions_only_give_the_full_pass_values_and_gradients(
        tmp_path) -> None:
    """The backend's LM head sees the loss mask's positions only (logits_to_keep); the
    log-probs, entropy and every parameter's gradient equal the all-positions pass."""
    from transformers import AutoModelForCausalLM

    from rollout.tiny import create_tiny_checkpoint
    from trainer.losses import log_probs_and_entropy, loss_positions, spread

    model = AutoModelForCausalLM.from_pretrained(create_tiny_checkpoint(tmp_path / "tiny"),
                                                 dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 60, (3, 12), generator=gen)
    targets = torch.randint(3, 60, (3, 12), generator=gen)
    mask = torch.zeros(3, 12)
    mask[0, 5:9] = mask[1, 2:12] = mask[2, 11] = 1
    weights = torch.rand(3, 12, generator=gen, dtype=torch.float64) * mask

    def objective(log_probs, entropy):
        return (weights * (log_probs + 0.1 * entropy)).sum()

    full = log_probs_and_entropy(model(input_ids=input_ids).logits, targets, 0.7, True)
    objective(*full).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    keep = loss_positions(mask)
    kept = log_probs_and_entropy(model(input_ids=input_ids, logits_to_keep=keep).logits,
                                 targets[keep], 0.7, True)
    log_probs, entropy = spread(kept[0], keep), spread(kept[1], keep)
    torch.testing.assert_close(log_probs, full[0] * mask, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, full[1] * mask, rtol=1e-12, atol=1e-12)
    objective(log_probs, entropy).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], rtol=1e-10, atol=1e-12)
    assert loss_positions(torch.zeros(2, 3)).sum() == 1  # a shard without loss tokens


def pg_value_and_grad(config: LossConfig, log_probs: list[float], advantages: list[float],
                      mask: list[float], rollout: list[float] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pg_loss, d Σ pg_loss / d log π, clipped) per token, in float64; old_log_probs is
    garbage (only ppo reads it)."""
    log_pi = torch.tensor(log_probs, dtype=torch.float64, requires_grad=True)
    garbage_old = torch.full_like(log_pi, -7.0)
    sampled = None if rollout is None else torch.tensor(rollout, dtype=torch.float64)
    terms = policy_gradient_loss(log_pi, garbage_old, torch.tensor(advantages,
                                 dtype=torch.float64), config,
                                 torch.tensor(mask, dtype=torch.float64), sampled)
    terms.pg_loss.sum().backward()
    return terms.pg_loss.detach(), log_pi.grad, terms.clipped


def test_cross_entropy_is_minus_log_pi_on_the_mask_whatever_the_advantage() -> None:
    log_probs, mask = [-0.3, -2.0, -1.1, -4.0], [1.0, 0.0, 1.0, 1.0]
    config = LossConfig(policy_loss="cross_entropy")
    for advantages in ([1.0, 1.0, 1.0, 1.0], [-3.0, 0.5, 0.0, 7.0]):
        value, grad, clipped = pg_value_and_grad(config, log_probs, advantages, mask)
        assert value.tolist() == [0.3, 0.0, 1.1, 4.0]
        assert grad.tolist() == [-1.0, 0.0, -1.0, -1.0]
        assert clipped.tolist() == [0.0] * 4


def test_importance_sampling_is_reinforce_weighted_by_pi_over_q() -> None:
    log_probs, rollout = [-0.5, -1.0, -2.0], [-1.0, -0.7, -2.0]
    advantages, mask = [2.0, -1.5, 0.5], [1.0, 1.0, 1.0]
    value, grad, clipped = pg_value_and_grad(LossConfig(policy_loss="importance_sampling"),
                                             log_probs, advantages, mask, rollout)
    ratio = [math.exp(p - q) for p, q in zip(log_probs, rollout, strict=True)]
    expected = [-a * r for a, r in zip(advantages, ratio, strict=True)]
    assert value.tolist() == pytest.approx(expected, rel=1e-12)
    assert grad.tolist() == pytest.approx(expected, rel=1e-12)  # d(−A·ρ)/d log π = −A·ρ
    assert clipped.tolist() == [0.0] * 3


def test_truncated_importance_sampling_keeps_the_gradient_at_the_cap() -> None:
    """ρ = 3, 0.5, 2.5 (masked out) and 4 with cap 2: the truncated tokens weigh −A·C in
    value and gradient (not 0, as a clipped ratio would give), the others −A·ρ."""
    rollout = [0.0, 0.0, 0.0, 0.0]
    log_probs = [math.log(3.0), math.log(0.5), math.log(2.5), math.log(4.0)]
    advantages, mask = [1.5, 2.0, 1.0, -0.5], [1.0, 1.0, 0.0, 1.0]
    config = LossConfig(policy_loss="importance_sampling", tis_cap=2.0)
    value, grad, clipped = pg_value_and_grad(config, log_probs, advantages, mask, rollout)
    expected = [-1.5 * 2.0, -2.0 * 0.5, 0.0, 0.5 * 2.0]
    assert value.tolist() == pytest.approx(expected, rel=1e-12)
    assert grad.tolist() == pytest.approx(expected, rel=1e-12)
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_importance_sampling_ignores_an_overflowing_masked_token(tis_cap: float | None
                                                                 ) -> None:
    """log π − log q = 1e4 on a masked-out token (exp overflows in any dtype): values and
    gradients stay finite, and 0 there."""
    config = LossConfig(policy_loss="importance_sampling", tis_cap=tis_cap)
    for dtype in (torch.float32, torch.float64):
        log_pi = torch.tensor([0.0, -0.2], dtype=dtype, requires_grad=True)
        rollout = torch.tensor([-1e4, -0.4], dtype=dtype)
        terms = policy_gradient_loss(log_pi, log_pi.detach(), torch.tensor([-1.0, 1.0],
                                     dtype=dtype), config, torch.tensor([0.0, 1.0]), rollout)
        terms.pg_loss.sum().backward()
        assert torch.isfinite(terms.pg_loss).all() and torch.isfinite(log_pi.grad).all()
        assert terms.pg_loss[0] == 0 and log_pi.grad[0] == 0 and terms.clipped[0] == 0
        assert float(terms.pg_loss.detach()[1]) == pytest.approx(-math.exp(0.2), rel=1e-6)
