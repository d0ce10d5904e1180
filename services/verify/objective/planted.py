r"""Planted errors: each replaces one production function of a check (:class:`Production`)
with a wrong one, so a test can show ``verify-objective`` failing on it. Handed in as a
parameter of :func:`services.verify.objective.verify_objective`, never read from the
environment; production itself is untouched.

    pg_sign                  the pg term's sign flipped (gradient ascent on the loss)
    kl_straight_through      k3+ without its stop-gradients, i.e. k3 (the forward KL's
                             expected gradient)
    entropy_temperature      the entropy taken at T = 1 instead of the sampling T
    correction_bounds        the rollout correction's weight neither truncated nor masked
    value_clip_side          the value loss takes the smaller branch (min, not max)
    bt_margin_sign           Bradley–Terry's margin r⁻ − r⁺ instead of r⁺ − r⁻
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from services.verify.objective.production import Production

UNBOUNDED = 1e300
"""A bound no weight reaches."""


def _pg_sign(production: Production) -> Production:
    def objective(*args: Any, gradient_of: str = "all", **kwargs: Any
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        value, sums = production.policy_objective(*args, gradient_of=gradient_of, **kwargs)
        return (-value if gradient_of == "pg" else value), sums
    return dataclasses.replace(production, policy_objective=objective)


def _with_loss(production: Production, change: Callable[[Any], Any]) -> Production:
    def objective(token: Any, micro: Any, loss: Any, *args: Any, **kwargs: Any
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return production.policy_objective(token, micro, change(loss), *args, **kwargs)
    return dataclasses.replace(production, policy_objective=objective)


def _kl_straight_through(production: Production) -> Production:
    # sg(k3) + (k2 − sg(k2)) with the sg dropped is k3 + k2 − k2 = k3
    return _with_loss(production, lambda loss: loss.model_copy(update={"kl_estimator": "k3"})
                      if loss.kl_estimator == "k3+" else loss)


def _unbounded(loss: Any) -> Any:
    update: dict[str, Any] = {}
    if loss.tis_cap is not None:
        update["tis_cap"] = UNBOUNDED
    correction = loss.rollout_correction
    if correction is not None:
        bounds = {"high": UNBOUNDED, "low": 0.0 if correction.mode == "mask" else None}
        update["rollout_correction"] = correction.model_copy(update=bounds)
    return loss.model_copy(update=update)


def _correction_bounds(production: Production) -> Production:
    return _with_loss(production, _unbounded)


def _entropy_temperature(production: Production) -> Production:
    def log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor,
                              temperature: float, with_entropy_grad: bool
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, _ = production.log_probs_and_entropy(logits, targets, temperature,
                                                        with_entropy_grad)
        _, entropy = production.log_probs_and_entropy(logits, targets, 1.0, with_entropy_grad)
        return log_probs, entropy
    return dataclasses.replace(production, log_probs_and_entropy=log_probs_and_entropy)


def _value_clip_side(production: Production) -> Production:
    def objective(values: torch.Tensor, micro: Any, value_clip: float | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        returns, old = micro.returns, micro.old_values
        squared = (values - returns).square()
        if value_clip is not None:
            clipped = old + (values - old).clamp(-value_clip, value_clip)
            squared = torch.minimum(squared, (clipped - returns).square())
        total = (0.5 * squared * micro.weights["value"]).sum()
        return total, total.detach().reshape(1)
    return dataclasses.replace(production, value_objective=objective)


def _bt_margin_sign(production: Production) -> Production:
    def objective(chosen: torch.Tensor, rejected: torch.Tensor, num_pairs: int,
                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return production.pair_objective(rejected, chosen, num_pairs, **kwargs)
    return dataclasses.replace(production, pair_objective=objective)


PLANTED_ERRORS: dict[str, tuple[tuple[str, ...], Callable[[Production], Production]]] = {
    "pg_sign": (("pg", "correction"), _pg_sign),  # a correction row is a pg term too
    "kl_straight_through": (("kl",), _kl_straight_through),
    "entropy_temperature": (("entropy",), _entropy_temperature),
    "correction_bounds": (("correction",), _correction_bounds),
    "value_clip_side": (("value",), _value_clip_side),
    "bt_margin_sign": (("bt",), _bt_margin_sign),
}
"""name -> (the families of rows it breaks, the Production it makes)."""


def planted_production(planted: frozenset[str] | set[str] | tuple[str, ...] = ()
                       ) -> Production:
    """Production with ``planted`` errors in (ValueError naming an unknown one)."""
    production = Production()
    for name in sorted(planted):
        if name not in PLANTED_ERRORS:
            raise ValueError(f"planted: unknown error {name!r}; one of "
                             f"{', '.join(PLANTED_ERRORS)}")
        production = PLANTED_ERRORS[name][1](production)
    return production
