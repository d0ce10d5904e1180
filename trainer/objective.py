r"""The one objective of a micro-batch, for every backend.

A backend produces, for the tokens this rank owns, fp32 log-probs of the sampled tokens
and the entropy under π_T = softmax(z / T) (and the reference model's log-probs when KL
is on). Everything else happens here, once:

    J_mb = Σ w_pg·ℓ_pg + β · Σ w_kl·ℓ_kl − α · Σ w_H·H          (β = kl_coef, α = entropy_coef)

over the policy's terms (trainer/terms.py), ℓ_pg from the configured policy loss
(trainer/losses/), with the per-token weights w = m·c of the step plan, so summing J_mb
over micro-batches and ranks gives the step's J exactly. The logged sums (``LOGGED_SUMS`` then one
``pg_loss/<mode>`` per aggregation mode) are unscaled Σ w·ℓ in float64; summed over
micro-batches and ranks they are each term's exact J (:func:`step_metrics`).

A sequence quantity (GSPO's ratio, a sequence-level rollout correction) is reduced over
the pieces of its sample before it is used: :func:`sample_sums`, over the CP group the
backend hands in (``cp_group``), each packed slot or padded row on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.aggregation import local_weighted_sum
from trainer.config import LossConfig
from trainer.losses import PolicyLossInputs, build_policy_loss, kl_penalty
from trainer.losses.rollout_correction import corrected_terms
from trainer.micro_batch import MicroBatch
from trainer.planted import (
    NOTHING_PLANTED,
    PLANTED_COEFFICIENT_ERROR,
    PLANTED_FACTOR_TERMS,
    Planted,
)
from trainer.terms import ENTROPY, KL, PG, POLICY_TERM_NAMES, POLICY_TERMS

LOGGED_SUMS = (*(term.logged for term in POLICY_TERMS), "clipped_tokens", "valid_tokens",
               "log_prob_abs_diff", "ratio_abs_dev",
               *(f"magnitude/{term.logged}" for term in POLICY_TERMS),
               "mismatch_k1", "correction_weight", "correction_dropped")
"""``magnitude/<term>`` = Σ|w·ℓ|: the scale a difference in that term is judged against.
``mismatch_k1`` = Σ m·(log π_rollout − log π_trainer), ``correction_weight`` = Σ m·W and
``correction_dropped`` = Σ m·1[dropped] (trainer/losses/rollout_correction.py)."""


@dataclass
class TokenLogProbs:
    """What a backend computes for one micro-batch shard, [b, s] fp32 each."""

    log_probs: torch.Tensor
    """log π_T(target), differentiable."""
    entropy: torch.Tensor
    """H(π_T) per position; differentiable only when the entropy term is on."""
    ref_log_probs: torch.Tensor | None = None
    """log π_ref,T(target) without a graph, when the KL term is on."""


def _sample_slots(micro: MicroBatch) -> torch.Tensor:
    """The sample of each token [b, s]: its slot in a packed row, its row when padded."""
    mask = micro.loss_mask
    if micro.sequence_ids is not None:
        return micro.sequence_ids.to(mask.device)
    return torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)


def sample_sums(values: torch.Tensor, micro: MicroBatch, cp_group: object | None = None
                ) -> torch.Tensor:
    """[b, s] -> [b, s]: each token holds its sample's total of ``values`` over every token
    of the sample, on every CP rank of ``cp_group`` (None: this shard holds the whole
    sample, cp 1). A sample is a packed row's slot (``sequence_ids``) or a padded row.
    Collective over ``cp_group`` (every CP rank holds the same rows and slots); detached,
    summed in float64 so that no layout's order of addition shows."""
    with torch.no_grad():
        slots = _sample_slots(micro).to(values.device)
        if micro.sequence_ids is None:
            num_samples = values.shape[0]
        elif micro.layout is not None:
            num_samples = micro.layout.num_slots
        else:
            num_samples = int(slots.max()) + 1
        totals = torch.zeros(num_samples, dtype=torch.float64, device=values.device)
        totals.index_add_(0, slots.reshape(-1), values.detach().double().reshape(-1))
        if cp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(totals, group=cp_group)
        return totals[slots].to(values.dtype)


def observation_tokens(micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hole [b, s] bool, source [b, s] index): a position whose mask is 0 between two
    valid tokens of its sample (an environment's observation inside a multi-turn
    response), and the valid token before it (itself elsewhere). A shard's tokens of one
    sample are in position order, so "between" is along the row (test hook only)."""
    valid = micro.loss_mask > 0
    sample = _sample_slots(micro)
    index = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)
    before = torch.where(valid, index, -1).cummax(dim=-1).values
    after = torch.where(valid, index, valid.shape[-1]).flip(-1).cummin(dim=-1).values.flip(-1)
    inside = (before >= 0) & (after < valid.shape[-1])
    same = ((sample.gather(-1, before.clamp(min=0)) == sample)
            & (sample.gather(-1, after.clamp(max=valid.shape[-1] - 1)) == sample))
    hole = ~valid & inside & same
    return hole, torch.where(hole, before, index)


def planted_loss_mask(micro: MicroBatch, planted: Planted = NOTHING_PLANTED) -> torch.Tensor:
    """Where a backend that computes log-probs at the loss mask's positions only must
    compute them: the loss mask, and the observation tokens when ``observation_tokens``
    is among this rank's ``planted`` errors (trainer/planted.py), so it reaches the
    gradient."""
    if "observation_tokens" not in planted:
        return micro.loss_mask
    hole, _ = observation_tokens(micro)
    return torch.where(hole, torch.ones_like(micro.loss_mask), micro.loss_mask)


def _planted_weights(micro: MicroBatch, planted: Planted) -> dict[str, torch.Tensor]:
    """The micro-batch's weights with the planted coefficient errors (test hook only)."""
    weights = dict(micro.weights)
    if "observation_tokens" in planted:  # each hole takes its sample's weight before it
        _, source = observation_tokens(micro)
        weights = {t: w.gather(-1, source.to(w.device)) for t, w in weights.items()}
    if "local_tokens" in planted:
        import torch.distributed as dist

        own = torch.stack([weights[t].sum() for t in PLANTED_FACTOR_TERMS]).double()
        total = own.clone()
        dist.all_reduce(total)  # every rank of the layout runs this call
        factor = torch.where(own > 0, total / (dist.get_world_size() * own), 1.0)
        weights.update({t: weights[t] * f for t, f in zip(PLANTED_FACTOR_TERMS, factor,
                                                          strict=True)})
    wrong = [t for t in PLANTED_FACTOR_TERMS if "shard_coefficient" in planted
             or (t == "entropy" and "entropy_coefficient" in planted)]
    if wrong:  # the sample with the most valid tokens in this shard
        sample = _sample_slots(micro)
        valid = sample[micro.loss_mask > 0]
        if valid.numel():
            chosen = sample == torch.bincount(valid).argmax()
            weights.update({t: torch.where(chosen, weights[t] * (1 + PLANTED_COEFFICIENT_ERROR),
                                           weights[t]) for t in wrong})
    return weights


def term_coefficients(loss: LossConfig, gradient_of: str = "all") -> dict[str, float]:
    """Coefficient of each term in the backward: the configured ones for training, or
    1 for the one term the verifier isolates (0 for the others)."""
    if gradient_of != "all":
        return {term: float(term == gradient_of) for term in POLICY_TERM_NAMES}
    coefficients = {term.name: 1.0 if term.coefficient is None
                    else float(getattr(loss, term.coefficient)) for term in POLICY_TERMS}
    if loss.kl_placement == "reward":  # the KL is in the rewards (rollout/kl_reward.py)
        coefficients[KL.name] = 0.0
    return coefficients


def micro_batch_objective(
    token: TokenLogProbs, micro: MicroBatch, loss: LossConfig, mode_names: list[str],
    planted: Planted = NOTHING_PLANTED, gradient_of: str = "all",
    cp_group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·ℓ of the terms for backward, the logged sums [len(LOGGED_SUMS) + modes]).

    A KL or entropy sum is always logged (entropy needs no reference model); it enters
    the backward only with a coefficient > 0. ``planted``: the errors this rank makes
    (a test's, trainer/planted.py: ``TrainerRank.planted``), handed in by the backend.
    ``cp_group``: the CP group when cp > 1 (sequence sums are reduced over it), else None;
    every CP rank calls this for the same micro-batch."""
    mask = micro.loss_mask
    weights = _planted_weights(micro, planted) if planted else micro.weights
    if "observation_tokens" in planted:  # a planted error (tests): holes trained too
        mask = torch.where(observation_tokens(micro)[0], torch.ones_like(mask), mask)
    if loss.old_log_probs == "rollout":
        old = micro.rollout_log_probs
    elif micro.old_log_probs is not None:  # the policy at the start of the rollout
        old = micro.old_log_probs
    else:  # the one update of a rollout: the old policy is this one, ρ = 1 exactly
        old = token.log_probs.detach()
    pg, correction = corrected_terms(build_policy_loss(loss), PolicyLossInputs(
        token.log_probs, old, micro.advantages, mask, micro.rollout_log_probs,
        per_sample_sum=lambda values: sample_sums(values, micro, cp_group)))
    kl = torch.zeros_like(pg.pg_loss)
    if token.ref_log_probs is not None:
        kl = kl_penalty(token.log_probs, token.ref_log_probs, loss.kl_estimator, mask)
    per_token = {PG.name: pg.pg_loss, KL.name: kl, ENTROPY.name: token.entropy}
    term_sums = {term.name: local_weighted_sum(per_token[term.name], weights[term.name])
                 for term in POLICY_TERMS}
    objective = pg.pg_loss.new_zeros(())
    coefficients = term_coefficients(loss, gradient_of)
    for term in POLICY_TERMS:  # entropy's sign is −1: a bonus
        coef, term_sum = coefficients[term.name], term_sums[term.name]
        if coef > 0 and term_sum.requires_grad:
            factor = 2.0 if term.name in planted else 1.0  # a planted error (tests)
            objective = objective + factor * coef * term.sign * term_sum
    with torch.no_grad():
        mismatch = torch.where(mask > 0, token.log_probs - micro.rollout_log_probs, 0.0)
        sums = torch.stack([
            *term_sums.values(), (pg.clipped * mask).sum(), mask.sum(),
            (mismatch.abs() * mask).sum(),
            ((pg.ratio - 1).abs() * mask).sum(),
            *[local_weighted_sum(per_token[term.name].abs(), weights[term.name].abs())
              for term in POLICY_TERMS],
            (-mismatch * mask).sum(),
            (mask if correction is None else correction.weight * mask).sum(),
            (0 * mask if correction is None else correction.dropped * mask).sum(),
            *[local_weighted_sum(pg.pg_loss, weights[k]) for k in mode_names],
        ]).detach().double()
    return objective, sums


def step_metrics(totals: torch.Tensor, mode_names: list[str]) -> dict[str, float]:
    """The step's metrics from the logged sums added over micro-batches and ranks."""
    values = dict(zip([*LOGGED_SUMS, *mode_names], totals.tolist(), strict=True))
    num_valid = max(values["valid_tokens"], 1)
    values["clip_fraction"] = values.pop("clipped_tokens") / num_valid
    # Train-inference mismatch: mean |log π_trainer − log π_rollout| per valid token.
    values["mismatch/log_prob_abs_diff"] = values.pop("log_prob_abs_diff") / num_valid
    # Mean |ρ − 1| per valid token: 0 on a rollout's first update, growing after it.
    values["ratio/mean_abs_dev"] = values.pop("ratio_abs_dev") / num_valid
    # k1 of KL(π_rollout ‖ π_trainer) on the engine's samples: E_rollout[log π_r − log π_t].
    values["mismatch/kl"] = values.pop("mismatch_k1") / num_valid
    values["rollout_correction/weight_mean"] = values.pop("correction_weight") / num_valid
    values["rollout_correction/masked_fraction"] = (values.pop("correction_dropped")
                                                    / num_valid)
    return values
