"""``trainer.loss.old_log_probs: proximal`` (decoupled PPO, trainer/losses/rollout_correction.py)
held to its formula written out here in float64, never the code under test:

    ℓ_t = −sg(min(π_prox/π_behav, cap)) · min(r_t·A_t, clip(r_t, 1 − ε, 1 + ε_h)·A_t),
    r_t = π_θ/π_prox

through what production calls (the step plan's packed micro-batches, the objective of
each, added up), on a batch whose samples' tokens come from two or three weight versions,
each token with its own behaviour log-prob; a planted error that uses one behaviour
log-prob per sample (its first token's, as a per-sample version would) fails the same
comparison. Also the config: what proximal resolves to, and the losses it is refused for."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from rollout.batch import RolloutBatch
from tests.trainer.helpers import random_train_batch
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.micro_batch import slice_for_plan
from trainer.objective import TokenLogProbs, micro_batch_objective
from trainer.step_plan import plan_step

D = torch.float64
VOCAB = 50
VERSION_SHIFTS = (0.9, 0.35, -0.2)
"""log π_prox − log π_behav of a token sampled 2, 1 and 0 versions ago: weights ≈ 2.46
(over the cap 2: truncated), 1.42 and 0.82."""


def versioned_batch(seed: int) -> tuple[RolloutBatch, torch.Tensor]:
    """(a batch with π_prox as its old log-probs and per-token behaviour log-probs, the
    version of each token [N, S]): each response is cut into up to three spans sampled by
    successive versions (a partial rollout continued across weight updates), so the
    behaviour log-probs of one sample's tokens come from different policies."""
    batch = random_train_batch(vocab_size=VOCAB, num_prompts=4, group_size=2, seed=seed,
                               per_token=True)
    gen = torch.Generator().manual_seed(seed)
    shape = batch.loss_mask.shape
    prox = batch.rollout_log_probs + 0.3 * torch.randn(shape, generator=gen)
    version = torch.zeros(shape, dtype=torch.long)
    for i in range(batch.num_samples):
        start, length = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
        cuts = sorted(torch.randint(0, length + 1, (2,), generator=gen).tolist())
        span = torch.arange(length)
        version[i, start:start + length] = (span >= cuts[0]).long() + (span >= cuts[1]).long()
    shift = torch.tensor(VERSION_SHIFTS)[version] + 0.05 * torch.randn(shape, generator=gen)
    behaviour = torch.where(batch.loss_mask > 0, prox - shift, batch.rollout_log_probs)
    return replace(batch, rollout_log_probs=behaviour).with_old_log_probs(prox), version


def reference_objective(batch: RolloutBatch, theta: torch.Tensor, loss: LossConfig
                        ) -> torch.Tensor:
    """J under sample_mean, (1/N) Σ_i (1/M_i) Σ_t m_it ℓ_it, with ℓ the formula of the
    module docstring (ppo), or under the same weight CISPO's −sg(min(r, 1 + ε_h))·A·log π_θ
    or GSPO's surrogate on s_it = sg(s_i)·π_θ/sg(π_θ), s_i = exp(mean over the sample's
    valid tokens of log r_t), in float64 on the whole batch; log π_θ = log π_prox + θ[token]."""
    m, adv = batch.loss_mask.to(D), batch.advantages.to(D)
    prox, behaviour = batch.old_log_probs.to(D), batch.rollout_log_probs.to(D)
    log_pi = prox + theta[batch.input_ids]
    valid = m > 0
    weight = torch.where(valid, torch.exp(prox - behaviour), 0.0).clamp(max=2.0)
    ratio = torch.exp(torch.where(valid, log_pi - prox, 0.0))
    high = 1 + (loss.eps_clip_high or loss.eps_clip)
    if loss.policy_loss == "gspo":
        log_ratio = torch.where(valid, log_pi - prox, 0.0).detach()
        sequence = torch.exp(log_ratio.sum(-1, keepdim=True)
                             / valid.sum(-1, keepdim=True).clamp(min=1))
        own = torch.where(valid, log_pi, 0.0)
        ratio = sequence * torch.exp(own - own.detach())
    if loss.policy_loss in ("ppo", "gspo"):
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - loss.eps_clip, high) * adv)
    else:
        surrogate = ratio.detach().clamp(max=high) * adv * log_pi
    per_token = torch.where(valid, -weight * surrogate, 0.0)
    counts = m.sum(-1)
    per_sample = torch.where(counts > 0, (m * per_token).sum(-1) / counts.clamp(min=1e-30),
                             0.0)
    return per_sample.sum() / batch.num_samples  # an empty sample still counts in N


def production_objective(batch: RolloutBatch, theta: torch.Tensor, loss: LossConfig,
                         drop_old: bool = False) -> torch.Tensor:
    """Σ over the plan's packed micro-batches of the objective production computes, each
    micro-batch's log π_θ = its log π_prox + θ[target]; ``drop_old``: as with one update
    per rollout (no π_prox pass: the batch carries no old log-probs)."""
    objective = ObjectiveConfig.compose(AggregationConfig(), loss, 16, 1.0)
    plan = plan_step(batch, objective, 1, 1, max_tokens_per_micro_batch=24)
    assert plan.packed and len(plan.micro_batches[0]) > 1
    total = theta.new_zeros(())
    for samples in plan.micro_batches[0]:
        micro = slice_for_plan(batch, plan, samples, 1, 0)
        log_probs = micro.old_log_probs.to(D) + theta[micro.targets]
        if drop_old:
            micro = replace(micro, old_log_probs=None)
        value, _ = micro_batch_objective(TokenLogProbs(log_probs, torch.zeros_like(log_probs)),
                                         micro, loss, plan.mode_metric_names)
        total = total + value
    return total


def value_and_grad(objective: object, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    theta = args[1]
    assert isinstance(theta, torch.Tensor)
    leaf = theta.detach().clone().requires_grad_(True)
    value = objective(args[0], leaf, *args[2:])  # type: ignore[operator]
    (grad,) = torch.autograd.grad(value, leaf)
    return value.detach(), grad


def matches(got: tuple[torch.Tensor, torch.Tensor],
            want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """(J, ∇J) equal to 1e-6 relative: production forms the weight exp(log π_prox − log
    π_behav) from the batch's float32 log-probs (measured here: 4e-8), the reference in
    float64."""
    return all(torch.allclose(g, w, rtol=1e-6, atol=1e-9) for g, w in zip(got, want,
                                                                          strict=True))


@pytest.mark.parametrize(("policy_loss", "eps_clip"), [("ppo", 0.2), ("cispo", 0.2),
                                                     ("gspo", 0.05)])
def test_proximal_is_decoupled_ppo_per_token_and_one_weight_per_sample_is_caught(
        policy_loss: str, eps_clip: float) -> None:
    batch, version = versioned_batch(seed=3)
    valid = batch.loss_mask > 0
    spans = [int(version[i][valid[i]].unique().numel()) for i in range(batch.num_samples)]
    assert max(spans) == 3 and 2 in spans  # samples span two and three versions
    theta = 0.3 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(1), dtype=D)
    loss = LossConfig(policy_loss=policy_loss, old_log_probs="proximal", eps_clip=eps_clip)
    log_ratio, counted = theta[batch.input_ids], valid  # log r_t = log π_θ/π_prox
    if policy_loss == "gspo":  # s_i, a sample's
        log_ratio = torch.where(valid, log_ratio, 0.0).sum(-1) / valid.sum(-1).clamp(min=1)
        counted = valid.any(-1)
    inside = (log_ratio.exp() - 1).abs()[counted] < eps_clip
    assert inside.any() and (~inside).any()  # the clip active on some, not all
    weight = torch.exp(batch.old_log_probs - batch.rollout_log_probs)[valid]
    assert (weight > 2).any() and (weight < 2).any()  # the cap is active on some tokens
    want = value_and_grad(reference_objective, batch, theta, loss)
    assert want[1].abs().sum() > 0
    assert matches(value_and_grad(production_objective, batch, theta, loss), want)

    # Planted: one behaviour log-prob per sample (its first valid token's) for every token.
    first = valid.to(torch.long).argmax(dim=-1, keepdim=True)
    one_per_sample = batch.rollout_log_probs.gather(-1, first).expand_as(valid)
    planted = replace(batch, rollout_log_probs=torch.where(valid, one_per_sample,
                                                           batch.rollout_log_probs))
    assert not matches(value_and_grad(production_objective, planted, theta, loss), want)


def test_one_update_per_rollout_weights_by_pi_theta_itself_without_a_prox_pass() -> None:
    """With one update the step starts at π_prox (θ = 0 here): the objective without old
    log-probs (production's path, no log-prob pass) is decoupled PPO's, value and
    gradient: −sg(min(π_prox/π_behav, 2))·A per token, gradient through r_t = 1."""
    batch, _ = versioned_batch(seed=4)
    theta = torch.zeros(VOCAB, dtype=D)
    loss = LossConfig(old_log_probs="proximal")
    want = value_and_grad(reference_objective, batch, theta, loss)
    assert want[1].abs().sum() > 0
    got = value_and_grad(production_objective, batch, theta, loss, True)
    assert matches(got, want)


def test_proximal_resolves_to_the_trainers_old_policy_and_a_token_truncation() -> None:
    """The driver computes π_prox wherever it computes ``trainer``'s old log-probs (it
    reads ``old_log_probs == "trainer"``); the weight is the user's correction if set."""
    loss = LossConfig(old_log_probs="proximal")
    assert loss.old_log_probs == "trainer"
    assert loss.correction is not None
    assert (loss.correction.level, loss.correction.mode, loss.correction.high) == (
        "token", "truncate", 2.0)
    capped = LossConfig(old_log_probs="proximal", policy_loss="gspo", tis_cap=3.0)
    assert capped.correction is not None and capped.correction.high == 3.0
    assert (capped.eps_clip, capped.eps_clip_high) == (3e-4, 4e-4)  # gspo's own clip
    areal = LossConfig(old_log_probs="proximal",
                       rollout_correction={"mode": "mask", "low": 0.0, "high": 5.0})
    assert areal.correction == areal.rollout_correction and areal.correction.high == 5.0
    # The resolved config read back is the same config.
    assert LossConfig.model_validate_json(loss.model_dump_json()) == loss


@pytest.mark.parametrize(("settings", "field"), [
    ({"policy_loss": "importance_sampling"}, "old_log_probs"),
    ({"policy_loss": "cross_entropy"}, "old_log_probs"),
    ({"policy_loss": "custom", "class_path": "my.module:Loss"}, "old_log_probs"),
    ({"tis_cap": None}, "tis_cap"),
    ({"rollout_correction": None}, "rollout_correction"),
])
def test_proximal_without_an_old_policy_or_a_weight_is_refused(settings: dict[str, object],
                                                               field: str) -> None:
    with pytest.raises(ValidationError, match=f"{field}: .*proximal"):
        LossConfig(old_log_probs="proximal", **settings)
