"""GSPO, CISPO and the off-policy correction, each held to its formula written out here in
float64 (never the code under test): per-token values and autograd gradients on a worked
batch, GSPO's sequence-level gradient under sample_mean with its clip active and
inactive, every correction level × mode, tis_cap as the legacy spelling of a token
truncation (the old behaviour), the logged mismatch and correction metrics."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from trainer.config import LossConfig, RolloutCorrectionConfig
from trainer.losses import PolicyLossInputs, build_policy_loss, policy_gradient_loss
from trainer.losses.rollout_correction import corrected_terms

D = torch.float64
MASK = torch.tensor([[1, 1, 1, 0, 0],    # sample 0: 3 valid tokens, then padding
                     [1, 1, 0, 1, 1],    # sample 1: an observation token (0) inside
                     [1, 1, 1, 1, 1],
                     [1, 1, 0, 0, 0]], dtype=D)
VALID = MASK > 0
LENGTHS = VALID.sum(dim=-1, keepdim=True).to(D)  # |y_i|


def worked_batch(seed: int, sequence_log_ratio: list[float], advantages: list[float]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log π_θ as a leaf, log π_old, log π_rollout, A [4, 5]): per-token log-ratios that
    differ within a sample, shifted so sample i's mean over its valid tokens is
    ``sequence_log_ratio[i]``; masked positions hold garbage (−inf and 1e4) that must
    never reach a value or a gradient."""
    gen = torch.Generator().manual_seed(seed)
    log_pi = -torch.rand(MASK.shape, generator=gen, dtype=D) * 3
    noise = 0.01 * torch.randn(MASK.shape, generator=gen, dtype=D) * MASK
    noise = noise - (noise.sum(-1, keepdim=True) / LENGTHS) * MASK
    ratio = noise + torch.tensor(sequence_log_ratio, dtype=D)[:, None] * MASK
    old = log_pi - ratio
    rollout = old - 0.05 * torch.randn(MASK.shape, generator=gen, dtype=D)
    log_pi = torch.where(VALID, log_pi, -torch.inf)
    old = torch.where(VALID, old, 1e4)
    adv = torch.tensor(advantages, dtype=D)[:, None].expand_as(MASK).clone()
    return log_pi.requires_grad_(True), old, rollout, adv


def sample_mean_objective(per_token: torch.Tensor) -> torch.Tensor:
    """J = (1/N) Σ_i (1/M_i) Σ_t m_it ℓ_it (binary mask here: M_i = |y_i|)."""
    return ((per_token * MASK).sum(-1) / LENGTHS[:, 0]).mean()


def leaf_grad(value: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(value, leaf)
    return grad


# ---------------------------------------------------------------- GSPO

def test_gspo_defaults_to_the_papers_clip_unless_the_user_sets_one() -> None:
    assert (LossConfig(policy_loss="gspo").eps_clip,
            LossConfig(policy_loss="gspo").eps_clip_high) == (3e-4, 4e-4)
    mine = LossConfig(policy_loss="gspo", eps_clip=0.1)
    assert (mine.eps_clip, mine.eps_clip_high) == (0.1, None)
    assert LossConfig(policy_loss="gspo", eps_clip_high=0.01).eps_clip == 0.2
    assert LossConfig().eps_clip == 0.2  # ppo keeps its own
    with pytest.raises(ValidationError, match="dual_clip_c: only policy_loss: ppo"):
        LossConfig(policy_loss="gspo", dual_clip_c=3.0)


def test_gspo_is_the_papers_sequence_objective_under_sample_mean() -> None:
    """Per-sample mean log-ratios 1e-3 (A > 0: above 1 + ε_high, clipped), 1e-4 (inside),
    −1e-3 (A > 0: below 1 − ε_low, where min keeps the unclipped branch) and −1e-3 with
    A < 0 (clipped): the token form's value per token is −min(s_i·A_i, clip(s_i)·A_i),
    and ∇J under sample_mean is autograd of the paper's J = −(1/N) Σ_i min(s_i·A_i,
    clip(s_i)·A_i) with s_i = exp(mean_t (log π_θ − log π_old)), i.e.
    −(1/N) Σ_i s_i·A_i·(1/|y_i|) Σ_t ∇log π_θ for an unclipped sample, 0 for a clipped one."""
    config = LossConfig(policy_loss="gspo")
    low, high = 1 - config.eps_clip, 1 + config.eps_clip_high
    log_pi, old, _, adv = worked_batch(0, [1e-3, 1e-4, -1e-3, -1e-3],
                                       [1.0, 0.7, 0.5, -0.8])
    terms = policy_gradient_loss(log_pi, old, adv, config, MASK)

    safe = torch.where(VALID, log_pi, 0.0)
    s = torch.exp(((safe - torch.where(VALID, old, 0.0)) * MASK).sum(-1) / LENGTHS[:, 0])
    a = adv[:, 0]
    paper = -torch.minimum(s * a, s.clamp(low, high) * a)  # [N]
    expected_tokens = torch.where(VALID, paper.detach()[:, None], 0.0)
    torch.testing.assert_close(terms.pg_loss.detach(), expected_tokens, rtol=1e-14, atol=0)
    assert terms.clipped.sum(-1).tolist() == [3.0, 0.0, 0.0, 2.0]  # samples 0 and 3 clipped

    ours = leaf_grad(sample_mean_objective(terms.pg_loss), log_pi)
    reference = leaf_grad(paper.mean(), log_pi)
    torch.testing.assert_close(ours, reference, rtol=1e-13, atol=0)
    written = (-(s * a).detach()[:, None] / LENGTHS * MASK) / len(a)  # the sequence gradient
    written[[0, 3]] = 0.0
    torch.testing.assert_close(ours, written, rtol=1e-13, atol=0)
    assert ours[1].abs().sum() > 0 and ours[2].abs().sum() > 0 and torch.isfinite(ours).all()


# ---------------------------------------------------------------- CISPO

def test_cispo_keeps_every_tokens_gradient_with_a_truncated_detached_weight() -> None:
    """ℓ_t = −sg(min(ρ_t, 1 + ε_high))·A_t·log π_θ(a_t): value per token and
    ∂ℓ_t/∂log π_θ(a_t) = −min(ρ_t, 1 + ε_high)·A_t, clipped where ρ_t > 1 + ε_high."""
    config = LossConfig(policy_loss="cispo", eps_clip_high=0.05)
    log_pi, old, _, adv = worked_batch(1, [0.1, -0.2, 0.02, 0.3], [1.0, -0.5, 0.3, -1.2])
    terms = policy_gradient_loss(log_pi, old, adv, config, MASK)
    rho = torch.exp(torch.where(VALID, log_pi.detach() - old, 0.0))
    weight = rho.clamp(max=1.05)
    expected = torch.where(VALID, -weight * adv * torch.where(VALID, log_pi.detach(), 0.0), 0.0)
    torch.testing.assert_close(terms.pg_loss.detach(), expected, rtol=1e-14, atol=0)
    grad = leaf_grad(terms.pg_loss.sum(), log_pi)
    torch.testing.assert_close(grad, torch.where(VALID, -weight * adv, 0.0), rtol=1e-14, atol=0)
    assert ((grad != 0) == VALID).all()  # a truncated token still has a gradient
    torch.testing.assert_close(terms.clipped, ((rho > 1.05) & VALID).to(D))
    assert 0 < terms.clipped.sum() < VALID.sum()


# ---------------------------------------------------------------- corrections

def correction_weight(level: str, mode: str, delta: torch.Tensor, low: float, high: float
                      ) -> torch.Tensor:
    """The module docstring's W_t, written out: δ summed or averaged per sample."""
    delta = torch.where(VALID, delta, 0.0)
    if level == "token":
        w = torch.exp(delta)
    elif level == "sequence":
        w = torch.exp(delta.sum(-1, keepdim=True)).expand_as(delta)
    else:
        w = torch.exp(delta.sum(-1, keepdim=True) / LENGTHS).expand_as(delta)
    if mode == "truncate":
        return torch.minimum(w, torch.tensor(high, dtype=D))
    return torch.where((w >= low) & (w <= high), w, 0.0)


def ppo_written(log_pi: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, eps: float
                ) -> torch.Tensor:
    rho = torch.exp(torch.where(VALID, log_pi, 0.0) - torch.where(VALID, old, 0.0))
    return torch.where(VALID, -torch.minimum(rho * adv, rho.clamp(1 - eps, 1 + eps) * adv), 0.0)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_each_correction_level_and_mode_is_its_formula(level: str, mode: str) -> None:
    """ppo (old_policy): ℓ_t·sg(W_t), W from π_old/π_rollout; importance_sampling
    (own_ratio, π_old = π_θ): value −A·W_t and gradient −A·W_t, W from sg(π_θ)/π_rollout.
    Bounds chosen so that some tokens or samples are cut and some are not."""
    bounds = {"token": (0.97, 1.03), "sequence": (0.9, 1.02), "geometric": (0.985, 1.01)}
    low, high = bounds[level]
    correction = {"level": level, "mode": mode, "high": high} | (
        {"low": low} if mode == "mask" else {})
    log_pi, old, rollout, adv = worked_batch(2, [0.05, -0.1, 0.02, 0.1], [1.0, -0.5, 0.3, -1.2])

    config = LossConfig(rollout_correction=correction)
    terms = policy_gradient_loss(log_pi, old, adv, config, MASK, rollout)
    weight = correction_weight(level, mode, old - rollout, low, high)
    expected = ppo_written(log_pi, old, adv, config.eps_clip) * weight
    torch.testing.assert_close(terms.pg_loss, expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(leaf_grad(terms.pg_loss.sum(), log_pi),
                               leaf_grad(expected.sum(), log_pi), rtol=1e-13, atol=0)
    uncorrected = ppo_written(log_pi, old, adv, config.eps_clip)
    cut = (weight != torch.exp(torch.where(VALID, old - rollout, 0.0))) if level == "token" \
        else (weight != correction_weight(level, "truncate", old - rollout, 0.0, 1e9))
    assert (cut & VALID).any() and (~cut & VALID).any(), "bounds must cut some, not all"
    assert not torch.allclose(terms.pg_loss, uncorrected)

    config = LossConfig(policy_loss="importance_sampling", rollout_correction=correction)
    terms = policy_gradient_loss(log_pi, old, adv, config, MASK, rollout)
    weight = correction_weight(level, mode, log_pi.detach() - rollout, low, high)
    torch.testing.assert_close(terms.pg_loss.detach(), torch.where(VALID, -adv * weight, 0.0),
                               rtol=1e-13, atol=0)
    torch.testing.assert_close(leaf_grad(terms.pg_loss.sum(), log_pi),
                               torch.where(VALID, -adv * weight, 0.0), rtol=1e-13, atol=0)


def test_tis_cap_is_a_token_truncation_and_the_old_behaviour() -> None:
    """tis_cap: c ≡ {level: token, mode: truncate, high: c}; ppo: ℓ_t·min(π_old/π_rollout,
    c); importance_sampling: value −A·min(ρ, c), gradient −A·min(ρ, c)·∇log π_θ, ρ =
    π_θ/π_rollout, a truncated token counted as clipped (the pre-correction formulas)."""
    cap = 1.03
    assert LossConfig(tis_cap=cap).correction == RolloutCorrectionConfig(high=cap)
    log_pi, old, rollout, adv = worked_batch(3, [0.05, -0.1, 0.02, 0.1], [1.0, -0.5, 0.3, -1.2])
    for policy_loss in ("ppo", "importance_sampling"):
        legacy = policy_gradient_loss(log_pi, old, adv,
                                      LossConfig(policy_loss=policy_loss, tis_cap=cap), MASK,
                                      rollout)
        spelled = policy_gradient_loss(log_pi, old, adv, LossConfig(
            policy_loss=policy_loss, rollout_correction={"high": cap}), MASK, rollout)
        assert torch.equal(legacy.pg_loss, spelled.pg_loss)
        assert torch.equal(legacy.clipped, spelled.clipped)
        if policy_loss == "ppo":
            weight = torch.exp(torch.where(VALID, old - rollout, 0.0)).clamp(max=cap)
            expected = ppo_written(log_pi, old, adv, 0.2) * weight
            torch.testing.assert_close(legacy.pg_loss, expected, rtol=1e-14, atol=0)
            continue
        rho = torch.exp(torch.where(VALID, log_pi.detach() - rollout, 0.0))
        truncated = torch.where(VALID, -adv * rho.clamp(max=cap), 0.0)
        torch.testing.assert_close(legacy.pg_loss.detach(), truncated, rtol=1e-14, atol=0)
        torch.testing.assert_close(leaf_grad(legacy.pg_loss.sum(), log_pi), truncated,
                                   rtol=1e-14, atol=0)
        torch.testing.assert_close(legacy.clipped, ((rho > cap) & VALID).to(D))
        assert legacy.clipped.sum() > 0


def test_correction_config_rules_name_their_field() -> None:
    for bad, match in [
        ({"tis_cap": 2.0, "rollout_correction": {"level": "sequence"}},
         "rollout_correction: tis_cap is the legacy spelling"),
        ({"rollout_correction": {"mode": "truncate", "low": 0.5}},
         "low: only mode: mask takes a lower bound"),
        ({"rollout_correction": {"mode": "mask", "low": 3.0, "high": 2.0}},
         "low: must be below high"),
        ({"policy_loss": "cross_entropy", "rollout_correction": {}},
         "rollout_correction: policy_loss: cross_entropy"),
    ]:
        with pytest.raises(ValidationError, match=match):
            LossConfig(**bad)
    assert RolloutCorrectionConfig(mode="mask", high=4.0).lower_bound == 0.25


def test_a_users_loss_is_not_corrected_unless_it_opts_in() -> None:
    """A custom PolicyLoss (rollout_correction None) sees its own ℓ; cross_entropy too."""
    log_pi, old, rollout, adv = worked_batch(4, [0.05, -0.1, 0.02, 0.1], [1.0, -0.5, 0.3, -1.2])
    config = LossConfig(policy_loss="cross_entropy", tis_cap=1.01)
    inputs = PolicyLossInputs(log_pi, old, adv, MASK, rollout)
    terms, correction = corrected_terms(build_policy_loss(config), inputs)
    assert correction is None
    torch.testing.assert_close(terms.pg_loss, torch.where(VALID, -log_pi, 0.0))


def test_the_objective_logs_mismatch_and_the_corrections_weights() -> None:
    """Through the objective production calls (packed micro-batches of a batch with
    fractional weights, added up): mismatch/kl = Σ m·(log π_rollout − log π_trainer) / Σ m,
    weight_mean = Σ m·W / Σ m and masked_fraction = Σ m·1[W out of range] / Σ m with the
    token weight W = exp(log π_old − log π_rollout), each written out from the micro-batch's
    own tensors; with no correction the weight is 1 and nothing is masked."""
    from tests.trainer.helpers import random_train_batch
    from trainer.config import AggregationConfig, ObjectiveConfig
    from trainer.micro_batch import slice_for_plan
    from trainer.objective import LOGGED_SUMS, TokenLogProbs, micro_batch_objective, step_metrics
    from trainer.step_plan import plan_step

    batch = random_train_batch(vocab_size=50, num_prompts=4, group_size=2, seed=5,
                               per_token=True)
    gen = torch.Generator().manual_seed(5)
    batch = batch.with_old_log_probs(batch.rollout_log_probs
                                     + 0.05 * torch.randn(batch.loss_mask.shape, generator=gen))
    for correction in ({"mode": "mask", "low": 0.97, "high": 1.03}, None):
        loss = LossConfig(rollout_correction=correction)
        objective = ObjectiveConfig.compose(AggregationConfig(), loss, 16, 1.0)
        plan = plan_step(batch, objective, 1, 1, max_tokens_per_micro_batch=24)
        totals, expected = None, torch.zeros(4, dtype=D)
        for samples in plan.micro_batches[0]:
            micro = slice_for_plan(batch, plan, samples, 1, 0)
            log_probs = (micro.old_log_probs.double() + 0.1 * torch.sin(
                micro.targets.double())).requires_grad_(True)
            _, sums = micro_batch_objective(TokenLogProbs(log_probs, torch.zeros_like(
                log_probs)), micro, loss, plan.mode_metric_names)
            totals = sums if totals is None else totals + sums
            m, valid = micro.loss_mask.double(), micro.loss_mask > 0
            w = torch.exp(torch.where(valid, micro.old_log_probs.double()
                                      - micro.rollout_log_probs.double(), 0.0))
            kept = (w >= 0.97) & (w <= 1.03) if correction else torch.ones_like(valid)
            expected += torch.stack([
                (m * (micro.rollout_log_probs.double() - log_probs.detach())).sum(),
                (m * (torch.where(kept, w, 0.0) if correction else 1.0)).sum(),
                (m * (~kept & valid)).sum(), m.sum()])
        metrics = step_metrics(totals, plan.mode_metric_names)
        assert len(totals) == len(LOGGED_SUMS) + len(plan.mode_metric_names)
        num_valid = float(expected[3])
        assert metrics["mismatch/kl"] == pytest.approx(float(expected[0]) / num_valid,
                                                       rel=1e-12)
        assert metrics["rollout_correction/weight_mean"] == pytest.approx(
            float(expected[1]) / num_valid, rel=1e-6)  # W in the batch's float32
        assert metrics["rollout_correction/masked_fraction"] == pytest.approx(
            float(expected[2]) / num_valid, rel=1e-12, abs=0)
        if correction:
            assert 0 < metrics["rollout_correction/masked_fraction"] < 1
        else:
            assert metrics["rollout_correction/weight_mean"] == 1.0
