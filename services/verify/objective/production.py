r"""The side under test: each term's exact expected J through production's own code.

Every outcome of every context is one padded row of a :class:`MicroBatch` with weight
w_it = m_it · μ(y_i) / L (μ the sampling distribution, L the response's tokens), so the
backward of production's Σ w·ℓ is Σ_y μ(y)·(1/L)·Σ_t ∇ℓ_t(y): the expected gradient with
the sampling not differentiated, exactly. The policy's log-probs and entropy come from
the functions the FSDP backend calls on its logits (``log_probs_and_entropy``,
``token_log_probs``: trainer/losses/log_probs.py), the terms from the functions it hands
them to (``micro_batch_objective``: trainer/objective.py, with ``gradient_of`` isolating
one term; ``micro_batch_value_objective``: trainer/value_loss.py; ``pair_objective``:
trainer/bradley_terry.py). A planted error (planted.py) replaces one of them in
:class:`Production`; nothing here reads the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.verify.objective.setting import Outcomes, Setting
from trainer.bradley_terry import pair_objective
from trainer.losses import log_probs_and_entropy, loss_positions, spread, token_log_probs
from trainer.micro_batch import MicroBatch
from trainer.objective import TokenLogProbs, micro_batch_objective, term_coefficients
from trainer.terms import POLICY_TERM_NAMES, VALUE
from trainer.value_loss import micro_batch_value_objective


@dataclass(frozen=True)
class Production:
    """The production functions a check calls (a planted error swaps one)."""

    log_probs_and_entropy: Callable[..., tuple[torch.Tensor, torch.Tensor]] = \
        log_probs_and_entropy
    token_log_probs: Callable[..., torch.Tensor] = token_log_probs
    policy_objective: Callable[..., tuple[torch.Tensor, torch.Tensor]] = micro_batch_objective
    value_objective: Callable[..., tuple[torch.Tensor, torch.Tensor]] = \
        micro_batch_value_objective
    pair_objective: Callable[..., tuple[torch.Tensor, torch.Tensor]] = pair_objective


def on_response(values: torch.Tensor, outcomes: Outcomes) -> torch.Tensor:
    """[R, L] per response token -> [R, S] at the positions predicting them, 0 elsewhere."""
    out = torch.zeros(outcomes.loss_mask.shape, dtype=torch.float64)
    start = outcomes.input_ids.shape[1] - outcomes.length - 1
    out[:, start:start + outcomes.length] = values
    return out


def _micro_batch(outcomes: Outcomes, weight: torch.Tensor, advantages: torch.Tensor,
                 rollout_log_probs: torch.Tensor, **optional: Any) -> MicroBatch:
    """The padded micro-batch of every outcome: row i weighs w_it = m_it · weight_i."""
    mask = outcomes.loss_mask
    weights = mask * weight[:, None]
    positions = torch.arange(mask.shape[1])[None, :].expand(mask.shape[0], -1)
    return MicroBatch(
        input_ids=outcomes.input_ids, position_ids=positions, targets=outcomes.targets,
        loss_mask=mask, advantages=mask * advantages[:, None],
        rollout_log_probs=rollout_log_probs,
        weights={name: weights for name in (*POLICY_TERM_NAMES, VALUE.name)}, **optional)


def policy_objective(production: Production, setting: Setting, outcomes: Outcomes,
                     loss: Any, term: str, temperature: float, sampling: torch.Tensor,
                     advantages: torch.Tensor, old_model: str | None) -> torch.Tensor:
    """Production's Σ w·ℓ of ``term`` (pg, kl, entropy) with coefficient 1, as the backward
    takes it. ``sampling`` [R, L]: log μ of each outcome's tokens (the engine's log-probs);
    ``old_model``: π_old's name in the setting, whose log-probs the trainer computes (None:
    the rollout's first update, ρ = 1: production takes the policy's own, detached)."""
    keep = loss_positions(outcomes.loss_mask)
    targets = outcomes.targets[keep]
    log_probs, entropy = production.log_probs_and_entropy(
        setting.logits("policy", outcomes)[keep], targets, temperature,
        term_coefficients(loss, term)["entropy"] > 0)

    def trainer_log_probs(model: str) -> torch.Tensor:
        with torch.no_grad():
            return spread(production.token_log_probs(setting.logits(model, outcomes)[keep],
                                                     targets, temperature), keep)

    old = None if old_model is None else trainer_log_probs(old_model)
    token = TokenLogProbs(spread(log_probs, keep), spread(entropy, keep),
                          trainer_log_probs("reference"))
    weight = sampling.sum(-1).exp() / outcomes.length
    micro = _micro_batch(outcomes, weight, advantages, on_response(sampling, outcomes),
                         old_log_probs=old)
    objective, _ = production.policy_objective(token, micro, loss, [], gradient_of=term)
    return objective


def value_objective(production: Production, setting: Setting, outcomes: Outcomes,
                    probability: torch.Tensor, returns: torch.Tensor,
                    old_values: torch.Tensor, value_clip: float | None) -> torch.Tensor:
    """Production's critic objective Σ w·ℓ over the outcomes (one token each), the
    critic's values at every position (as its head returns them)."""
    values = setting.critic(outcomes.input_ids).logits[..., 0]
    zeros = torch.zeros_like(outcomes.loss_mask)
    micro = _micro_batch(outcomes, probability, zeros[:, 0], zeros,
                         returns=on_response(returns[:, None], outcomes),
                         old_values=on_response(old_values[:, None], outcomes))
    objective, _ = production.value_objective(values, micro, value_clip)
    return objective


def pair_term(production: Production, setting: Setting, outcomes: Outcomes,
              chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None,
              center: float) -> torch.Tensor:
    """Production's Bradley–Terry objective over the pairs (indices into the outcomes),
    each outcome scored at its last token; ``margin`` [P] and ``center`` as TRL's."""
    scores = setting.critic(outcomes.input_ids).logits[:, -1, 0]
    objective, _ = production.pair_objective(scores[chosen], scores[rejected], len(chosen),
                                             margin=margin, center_coefficient=center)
    return objective
