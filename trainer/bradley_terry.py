r"""The Bradley–Terry loss of a reward model on preference pairs, exact under every layout.

For one optimizer step of P pairs (prompt x_p, chosen y⁺_p, rejected y⁻_p), with
r(x, y) the model's score (rollout/reward_text.py) and Δ_p = r(x_p, y⁺_p) − r(x_p, y⁻_p):

    J  = −(1/P) Σ_p log σ(Δ_p)                   the loss
    accuracy = (1/P) Σ_p [Δ_p > 0]              margin = (1/P) Σ_p Δ_p

Both sequences of a pair stay in one micro-batch of one DP rank, so J = Σ_p w·ℓ_p with
the one weight w = 1/P fixed from the step before it is split: each rank backpropagates
w · Σ over its own pairs, micro-batches accumulate by addition and gradients are SUMMED
over the DP ranks (FSDP averages: ``aggregation.sum_reduction_factor``, applied by the
backend). Packing, padding and micro-batching therefore move neither J nor ∇J. An empty
micro-batch (a rank with fewer micro-batches than another, kept in step) has weight 0.

The logged values are sums over every rank's pairs divided by P once: never a mean of
micro-batch means.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAIR_SUMS = ("loss", "accuracy", "margin", "score/chosen", "score/rejected")
"""The per-step sums every rank adds up (then ÷ P): −log σ(Δ), [Δ > 0], Δ, r⁺, r⁻."""


def pair_objective(chosen: torch.Tensor, rejected: torch.Tensor, num_pairs: int,
                   weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(w · Σ −log σ(r⁺ − r⁻) / P over these pairs, to backpropagate; their PAIR_SUMS,
    float64, detached). ``chosen``/``rejected`` [k]: the pairs' scores in float32 or
    better; ``weight`` 0 makes an empty micro-batch's forward count for nothing."""
    margin = chosen - rejected
    loss = -F.logsigmoid(margin)
    objective = loss.sum() * (weight / num_pairs)
    sums = torch.stack([loss.sum(), (margin > 0).sum().to(loss.dtype), margin.sum(),
                        chosen.sum(), rejected.sum()]).detach().double()
    return objective, sums * weight


def pair_metrics(sums: torch.Tensor, num_pairs: int, prefix: str = "") -> dict[str, float]:
    """The step's (or evaluation's) metrics from PAIR_SUMS summed over every rank."""
    return {f"{prefix}{name}": float(value) / num_pairs
            for name, value in zip(PAIR_SUMS, sums.tolist(), strict=True)}
