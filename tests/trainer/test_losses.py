from __future__ import annotations

import math

import pytest
import torch

from trainer.config import LossConfig
from trainer.losses import entropy_from_logits, kl_penalty, policy_gradient_loss


def test_ppo_clip_takes_the_pessimistic_branch() -> None:
    log_ratio = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))
    advantages = torch.tensor([1.0, -1.0, 1.0, 1.0])
    terms = policy_gradient_loss(log_ratio, torch.zeros(4), advantages, LossConfig(eps_clip=0.2))
    # A>0, ρ=1.5: max(-1.5, -1.2) = -1.2 (clipped); A<0, ρ=0.5: max(0.5, 0.8) = 0.8 (clipped)
    # A>0, ρ=1.1: inside the range; A>0, ρ=0.7: max(-0.7, -0.8) = -0.7 (not clipped)
    assert terms.pg_loss.tolist() == pytest.approx([-1.2, 0.8, -1.1, -0.7])
    assert terms.clipped.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_clip_higher_and_dual_clip() -> None:
    log_ratio = torch.log(torch.tensor([1.5, 5.0]))
    advantages = torch.tensor([1.0, -1.0])
    config = LossConfig(eps_clip=0.2, eps_clip_high=0.28, dual_clip_c=3.0)
    terms = policy_gradient_loss(log_ratio, torch.zeros(2), advantages, config)
    # ρ=1.5 clipped at 1.28; ρ=5 with A<0: max(5, 1.2)=5, dual clip bounds it at c=3.
    assert terms.pg_loss.tolist() == pytest.approx([-1.28, 3.0])


def test_truncated_importance_sampling_weight() -> None:
    log_probs = torch.log(torch.tensor([0.5, 0.5]))
    rollout = torch.log(torch.tensor([0.25, 0.4]))  # π_trainer/π_rollout = 2 and 1.25
    config = LossConfig(tis_cap=1.5)
    terms = policy_gradient_loss(log_probs, log_probs, torch.ones(2), config, rollout)
    assert terms.pg_loss.tolist() == pytest.approx([-1.5, -1.25])


def test_kl_estimators() -> None:
    log_probs, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    delta = math.log(0.25) - math.log(0.5)
    assert kl_penalty(log_probs, ref, "k1").item() == pytest.approx(-delta)
    assert kl_penalty(log_probs, ref, "k2").item() == pytest.approx(0.5 * delta**2)
    assert kl_penalty(log_probs, ref, "k3").item() == pytest.approx(math.exp(delta) - 1 - delta)
    big = kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "low_var_kl")
    assert big.item() == 10.0


def test_entropy_of_uniform_is_log_vocab() -> None:
    entropy = entropy_from_logits(torch.zeros(2, 3, 7))
    assert entropy.flatten().tolist() == pytest.approx([math.log(7)] * 6)
