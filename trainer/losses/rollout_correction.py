r"""Off-policy correction (``trainer.loss.rollout_correction``; ``tis_cap: c`` is its legacy
spelling {level: token, mode: truncate, high: c}): the engine's sampler π_rollout is not
the trainer's π_old (other kernels, precision, stale weights under async), so each
token's loss is reweighted by how far apart they are on the sampled tokens.

With δ_t = log π_old(a_t) − log π_rollout(a_t) on the valid tokens (m_t > 0) of sample i:

    token:      w_t = exp(δ_t)
    sequence:   w_i = exp(Σ_t δ_t)             (Π_t ρ_t; verl's rollout_corr sequence mode)
    geometric:  w_i = exp((1/|y_i|) Σ_t δ_t)    (GSPO's length-normalised ratio)

    truncate:   ℓ_t ← sg(min(w, high)) · ℓ_t                  (TIS)
    mask:       ℓ_t ← sg(w · 1[low ≤ w ≤ high]) · ℓ_t         (IcePop; low = 1/high unset)

so mask drops a token (token level) or a whole sample (sequence, geometric) whose weight
is out of range and keeps the weight of the others. Σ_t runs over the sample's whole
response on every CP rank and packed piece (``PolicyLossInputs.sample_sum``), log-weights
are clamped to ±MAX_LOG_RATIO before ``exp``, and no weight has a graph.

How a loss takes it (``PolicyLoss.rollout_correction``): ``old_policy`` (ppo, gspo,
cispo) multiplies ℓ_t by the corrected weight W_t; ``own_ratio`` (importance_sampling)
already carries ρ_t = π_θ/π_rollout, i.e. its π_old is π_θ itself, so δ uses sg(log π_θ)
and ℓ_t is multiplied by W_t / ρ_t: value −A·W_t, gradient −A·W_t·∇log π_θ. There a token
whose weight the correction lowered counts as clipped (its own ratio is what is cut).

Decoupled PPO (``old_log_probs: proximal``; Hilton et al. 2021, "batch size-invariance";
Fu et al. 2025, AReaL). With partial rollouts a sample's tokens come from several weight
versions: π_behav(a_t) is each token's own behaviour log-prob (``rollout_log_probs[i, t]``,
of the version that sampled it) and π_prox the trainer's policy at the step's start (the
log-prob pass of ``old_log_probs: trainer``). For ppo, with r_t = π_θ(a_t)/π_prox(a_t):

    ℓ_t = −sg(min(π_prox(a_t)/π_behav(a_t), high)) · min(r_t·A_t, clip(r_t, 1 − ε, 1 + ε_h)·A_t)

(gspo's and cispo's ℓ_t take the same weight). That is this module's token truncation
with π_old = π_prox and π_rollout = π_behav, so ``proximal`` is a recipe resolved in
trainer/config.py (``trainer`` plus {level: token, mode: truncate} unless the user sets a
correction), not a second code path. Against AReaL's ``ppo_actor_loss_fn``
(areal/utils/functional.py): the same ratio, clip and dual clip, the weight applied after
them and without a graph, π_prox computed once per rollout before its mini-batches
(``recompute_logprob``). It differs in (1) the cap: AReaL drops a token whose weight
exceeds ``behav_imp_weight_cap`` (none by default; its recipes use 5) and keeps the others'
weights uncapped, Tally truncates by default; AReaL's rule is ``rollout_correction:
{level: token, mode: mask, low: 0, high: 5}``; (2) with one update per rollout π_prox is
π_θ's own log-probs detached (the same weights, so no second forward), AReaL runs the
pass; (3) the aggregation is Tally's (AReaL's is a token mean per micro-batch).

Logged (trainer/objective.py): ``rollout_correction/weight_mean``, the mean corrected
weight W over valid tokens (1 with no correction), and ``rollout_correction/masked_fraction``,
the share of valid tokens mode mask dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainer.config import RolloutCorrectionConfig
from trainer.losses.base import MAX_LOG_RATIO, PolicyLoss, PolicyLossInputs, PolicyLossTerms


@dataclass
class Correction:
    """Per-token [.., T], without a graph."""

    weight: torch.Tensor
    """W_t: the corrected weight (truncated, or masked to 0)."""
    dropped: torch.Tensor
    """1.0 on a valid token mode mask gave weight 0, else 0."""


def correction_weights(log_ratio: torch.Tensor, inputs: PolicyLossInputs,
                       config: RolloutCorrectionConfig) -> Correction:
    """W_t (module docstring) from δ_t = ``log_ratio`` (masked positions ignored)."""
    valid = inputs.loss_mask > 0
    delta = torch.where(valid, log_ratio.detach(), 0.0)
    if config.level == "token":
        log_weight = delta
    elif config.level == "sequence":
        log_weight = inputs.sample_sum(delta)
    else:
        log_weight = inputs.sample_mean(delta)
    weight = torch.exp(log_weight.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if config.mode == "truncate":
        return Correction(weight.clamp(max=config.high), torch.zeros_like(weight))
    keep = (weight >= config.lower_bound) & (weight <= config.high)
    return Correction(torch.where(keep, weight, 0.0), (~keep & valid).to(weight.dtype))


def corrected_terms(loss: PolicyLoss, inputs: PolicyLossInputs
                    ) -> tuple[PolicyLossTerms, Correction | None]:
    """The loss's terms with the configured correction applied (the one place it is),
    and the correction (None when off, for this loss, or without rollout log-probs)."""
    terms = loss(inputs)
    config = loss.config.correction
    if config is None or loss.rollout_correction is None or inputs.rollout_log_probs is None:
        return terms, None
    behaviour = (inputs.old_log_probs if loss.rollout_correction == "old_policy"
                 else inputs.log_probs.detach())
    correction = correction_weights(behaviour - inputs.rollout_log_probs, inputs, config)
    if loss.rollout_correction == "old_policy":
        return replace(terms, pg_loss=terms.pg_loss * correction.weight), correction
    # own_ratio: ℓ carries ρ_t already; the same expression as before the correction
    # had a home (bit-identical under tis_cap): ρ·sg(min(ρ, c)/ρ).
    valid = inputs.loss_mask > 0
    own = torch.exp(torch.where(valid, behaviour - inputs.rollout_log_probs, 0.0)
                    .clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    factor = correction.weight / own
    lowered = ((factor < 1) & valid).to(terms.clipped.dtype)
    return replace(terms, pg_loss=terms.pg_loss * factor,
                   clipped=torch.maximum(terms.clipped, lowered)), correction
