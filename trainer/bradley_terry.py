r"""The Bradley–Terry loss of a reward model on preference pairs, with TRL's margin and
reward-centring terms, exact under every layout.

For one optimizer step of P pairs (prompt x_p, chosen y⁺_p, rejected y⁻_p, margin m_p,
0 when the data gives none), with r(x, y) the model's score (rollout/reward_text.py),
r⁺_p = r(x_p, y⁺_p), r⁻_p = r(x_p, y⁻_p), Δ_p = r⁺_p − r⁻_p and c the
``center_rewards_coefficient``:

    J  = −(1/P) Σ_p log σ(Δ_p − m_p)  +  c · (1/P) Σ_p (r⁺_p + r⁻_p)²       the loss
    accuracy = (1/P) Σ_p [Δ_p > 0]              margin = (1/P) Σ_p Δ_p

This is TRL's ``RewardTrainer.compute_loss``: ``-logsigmoid(r_c - r_r - margin).mean()``
plus ``center_rewards_coefficient * mean((r_c + r_r) ** 2)`` (the centring term of
Eisenstein et al. 2023, "Helping or Herding?", which pulls each pair's mean score to 0 so
the scale is anchored). Its accuracy ignores the margin, as TRL's does.

Both means are over the P pairs of the whole step — not over a rank's or a micro-batch's
pairs. Both sequences of a pair stay in one micro-batch of one DP rank, so
J = Σ_p w·ℓ_p with ℓ_p = −log σ(Δ_p − m_p) + c (r⁺_p + r⁻_p)² and the one weight
w = 1/P fixed from the step before it is split: each rank backpropagates w · Σ over its
own pairs, micro-batches accumulate by addition and gradients are SUMMED over the DP
ranks (FSDP averages: ``aggregation.sum_reduction_factor``, applied by the backend).
Packing, padding and micro-batching therefore move neither J nor ∇J. An empty
micro-batch (a rank with fewer micro-batches than another, kept in step) has weight 0.

The logged values are sums over every rank's pairs divided by P once: never a mean of
micro-batch means.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAIR_SUMS = ("loss", "accuracy", "margin", "score/chosen", "score/rejected",
             "loss/bradley_terry", "score/centring")
"""The per-step sums every rank adds up (then ÷ P): ℓ (the whole loss), [Δ > 0], Δ, r⁺,
r⁻, −log σ(Δ − m) (the Bradley–Terry term alone) and (r⁺ + r⁻)² (what centring
penalises, logged whatever c is)."""


def pair_objective(chosen: torch.Tensor, rejected: torch.Tensor, num_pairs: int,
                   weight: float = 1.0, margin: torch.Tensor | None = None,
                   center_coefficient: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(w · Σ ℓ_p / P over these pairs, to backpropagate; their PAIR_SUMS, float64,
    detached). ``chosen``/``rejected`` [k]: the pairs' scores in float32 or better;
    ``margin`` [k]: their m_p (None: 0; cast to the scores' dtype);
    ``center_coefficient``: c; ``num_pairs``: the step's P, never these pairs' count;
    ``weight`` 0 makes an empty micro-batch's forward count for nothing."""
    delta = chosen - rejected
    shifted = delta if margin is None else delta - margin.to(chosen)
    bradley_terry = -F.logsigmoid(shifted)
    centring = (chosen + rejected) ** 2
    loss = bradley_terry + center_coefficient * centring
    objective = loss.sum() * (weight / num_pairs)
    sums = torch.stack([loss.sum(), (delta > 0).sum().to(loss.dtype), delta.sum(),
                        chosen.sum(), rejected.sum(), bradley_terry.sum(),
                        centring.sum()]).detach().double()
    return objective, sums * weight


def pair_metrics(sums: torch.Tensor, num_pairs: int, prefix: str = "") -> dict[str, float]:
    """The step's (or evaluation's) metrics from PAIR_SUMS summed over every rank."""
    return {f"{prefix}{name}": float(value) / num_pairs
            for name, value in zip(PAIR_SUMS, sums.tolist(), strict=True)}
