r"""The critic's objective: the clipped value loss under the aggregation contract.

For response token t of sample i with the critic's value V_it (differentiable), its value
at the rollout V^old_it, the GAE target R_it (rollout/advantages.py) and ε = value_clip:

    ℓ_it = ½ · max((V_it − R_it)², (V^old_it + clip(V_it − V^old_it, −ε, ε) − R_it)²)
    (value_clip None:  ℓ_it = ½ · (V_it − R_it)²)

    J_value = Σ_i Σ_t w_it · ℓ_it,   w_it = m_it · c_i

with the per-sample coefficients c_i of the critic's aggregation mode (``critic.
aggregation``, default the job's), computed by the same step plan as the policy's terms,
so the value loss is exact under every DP × CP × packing layout and mini-batch exactly as
pg is (docs/loss-aggregation.md). The value term has its own weights,
``micro.weights["value"]`` (trainer/terms.py ``VALUE``: planned under the critic
objective's main aggregation).
"""

from __future__ import annotations

import torch

from trainer.aggregation import local_weighted_sum
from trainer.micro_batch import MicroBatch
from trainer.terms import VALUE

VALUE_SUMS = ("value_loss", "clipped_tokens", "valid_tokens", "values", "magnitude/value")
"""The critic's logged sums, in this order: Σ w·ℓ, Σ m over the tokens where the clipped
branch is the larger, Σ m, Σ m·V, Σ |w·ℓ| (what a difference in J_value is judged
against)."""
PLANTED_VALUE_ERROR = "value"
"""The planted error (trainer/planted.py) that doubles rank 0's share
of the value loss's gradient, so a test shows the verifier catching it."""


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       value_clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ℓ_it, 1.0 where the clipped branch is the larger) of the module docstring, [b, s]
    each, in ``values``' dtype."""
    old, target = old_values.to(values.dtype), returns.to(values.dtype)
    unclipped = (values - target).pow(2)
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped = (old + (values - old).clamp(-value_clip, value_clip) - target).pow(2)
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype)


def micro_batch_value_objective(values: torch.Tensor, micro: MicroBatch,
                                value_clip: float | None, planted: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·ℓ for backward, the logged sums [len(VALUE_SUMS)] float64) of one micro-batch
    shard; ``values`` [b, s] at next-token positions, like ``micro``'s tensors.
    ``planted``: this rank's share doubled (a test's planted error)."""
    assert micro.returns is not None and micro.old_values is not None, \
        "the critic trains on a batch with returns and values (PPO with a critic)"
    mask, weights = micro.loss_mask, micro.weights[VALUE.name]
    loss, clipped = clipped_value_loss(values, micro.old_values, micro.returns, value_clip)
    total = local_weighted_sum(loss, weights)
    objective = total * (2.0 if planted else 1.0)
    with torch.no_grad():
        sums = torch.stack([
            total, (clipped * mask).sum(), mask.sum(),
            (values.detach() * mask).sum(), local_weighted_sum(loss.abs(), weights.abs()),
        ]).detach().double()
    return objective, sums


def value_step_metrics(totals: torch.Tensor) -> dict[str, float]:
    """The critic step's metrics from its logged sums added over micro-batches and ranks."""
    values = dict(zip(VALUE_SUMS, totals.tolist(), strict=True))
    valid = values["valid_tokens"] or 1.0
    return {"value_loss": values["value_loss"],
            "clip_fraction": values["clipped_tokens"] / valid,
            "values_mean": values["values"] / valid,
            "valid_tokens": values["valid_tokens"],
            "magnitude/value": values["magnitude/value"]}
