r"""The loss terms, one registry: what the step plan weights, the objective sums, the
verifier compares and the metrics log. A new term is one entry here (and its ℓ).

Each term is J_term = Σ_it w_it · ℓ_it with the weights w = m · c of its own aggregation
(trainer/aggregation.py), and enters its role's objective as sign · coefficient · J_term:

    policy  (trainer/objective.py)   J = J_pg + kl_coef · J_kl − entropy_coef · J_entropy
    value   (trainer/value_loss.py)  J = J_value      the critic's clipped value loss
    score   (trainer/bradley_terry.py) J = J_bt       a reward model's Bradley–Terry loss

Kept free of torch and pydantic: the config, the controller and the dashboard read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["policy", "value", "score"]


@dataclass(frozen=True)
class LossTerm:
    name: str
    """The term's name in configs, plans and the verifier (``gradient_of``, planted errors)."""
    logged: str
    """Its J's name in a step's logged sums and metrics."""
    role: Role
    """The rank role whose objective it belongs to (ARCHITECTURE.md: ranks are roles)."""
    sign: float = 1.0
    """+1 a loss, −1 a bonus (entropy is maximised)."""
    coefficient: str | None = None
    """The ``trainer.loss`` field holding its coefficient; None: 1 (the role's main term)."""
    progress_format: str = ".4f"
    """How the progress line prints its value."""
    aggregation: str | None = None
    """The ``ObjectiveConfig`` field holding its aggregation: the step plan gives it its
    own weights w = m · c (``micro.weights[name]``); None: not planned (bt weighs pairs)."""


PG = LossTerm("pg", "pg_loss", "policy", progress_format="+.4f", aggregation="pg")
KL = LossTerm("kl", "kl", "policy", coefficient="kl_coef", aggregation="kl")
ENTROPY = LossTerm("entropy", "entropy", "policy", sign=-1.0, coefficient="entropy_coef",
                   progress_format=".3f", aggregation="entropy")
VALUE = LossTerm("value", "value_loss", "value", aggregation="pg")
"""The critic's objective carries the value loss's aggregation in its main field
(services/config/job.py ``critic_objective_config``), never a custom reducer."""
BT = LossTerm("bt", "loss", "score")

TERMS: dict[str, LossTerm] = {term.name: term for term in (PG, KL, ENTROPY, VALUE, BT)}
"""Every loss term by name, the policy's first (the order of its logged sums)."""


def terms_of(role: Role) -> tuple[LossTerm, ...]:
    """The terms of one role's objective, in registry order."""
    return tuple(term for term in TERMS.values() if term.role == role)


POLICY_TERMS = terms_of("policy")
"""pg, kl, entropy: the terms of the policy's objective, each with its own aggregation."""
POLICY_TERM_NAMES = tuple(term.name for term in POLICY_TERMS)
PLANNED_TERMS = tuple(term for term in TERMS.values() if term.aggregation is not None)
"""pg, kl, entropy, value: the terms the step plan weights, each under its aggregation."""
