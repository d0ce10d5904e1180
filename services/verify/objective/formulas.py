r"""Each term's documented formula, written out here apart from production (the checker's
reference). Every formula reads :class:`Policies` — log-probs of every outcome under each
policy, from the checker's own tempered log-softmax (setting.py) — and returns a scalar
whose value is the term's documented expectation and whose autograd is its documented
expected gradient (:func:`documented` where the two differ: sg(x) = x.detach()).

Policy losses (docs: trainer/losses/<name>.py), per token t of outcome y, ρ_t = π/π_old:

    ppo                  ℓ_t = max(−A·ρ_t, −A·clip(ρ_t, 1−ε_low, 1+ε_high)); dual clip c:
                         for A < 0, ℓ_t ← min(ℓ_t, −A·c)
    gspo                 s = exp(mean_t log ρ_t); ℓ_t = max(−A·s_t, −A·clip(s_t, ..)) with
                         s_t = sg(s)·π_t/sg(π_t); off-policy held to the paper's sequence
                         objective E_μ[max(−A·s, −A·clip(s, ..))]
    cispo                ℓ_t = −sg(min(ρ_t, 1+ε_high))·A·log π_t
    importance_sampling  ℓ_t = −A·π_t/μ_t; expected gradient −∇Σ_y π(y)·A(y)
    cross_entropy        ℓ_t = −log π_t: E_μ is the cross-entropy H(μ, π)

At ρ = 1 (the rollout's first update) every PG loss's expected gradient is the policy
gradient theorem's, −∇Σ_y π(y)·A(y) (GSPO's ÷|y| from its length-normalised ratio).

Off-policy correction (trainer/losses/rollout_correction.py), δ_t = log π_b − log μ_t with
π_b = π_old (ppo, gspo, cispo) or sg(π_θ) (importance_sampling, whose ratio is π_θ/μ):
w = exp(δ_t) (token), exp(Σ_t δ_t) (sequence), exp(mean_t δ_t) (geometric); truncate
min(w, high), mask w·1[low ≤ w ≤ high]; ℓ_t ← sg(W)·ℓ_t, or for importance_sampling
value −A·W_t and gradient −A·W_t·∇log π_t.

KL estimators (docs/loss-aggregation.md's table), expected gradient as a loss term:
k1 → 0, k2 → ∇KL(π‖ref), k3 and low_var_kl → ∇KL(ref‖π), k3+ → ∇KL(π‖ref), with
KL(π‖ref) = Σ π (log π − log ref). Entropy's contribution −H = Σ π log π (a bonus).
Value (trainer/value_loss.py): ½·max((V−R)², (clip(V, V_old ± ε) − R)²). Bradley–Terry
(trainer/bradley_terry.py): −(1/P) Σ log σ(r⁺ − r⁻ − m) + c·(1/P) Σ (r⁺ + r⁻)².
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Policies:
    """Every outcome of every context, [P, K, L] per token (K = V^L outcomes, L tokens)."""

    log_pi: torch.Tensor
    """log π_θ, differentiable."""
    log_old: torch.Tensor
    """log π_old: the policy at the rollout's start."""
    log_mu: torch.Tensor
    """log μ: the engine, which sampled the outcomes."""
    log_ref: torch.Tensor
    """log π_ref: the KL's reference."""
    advantages: torch.Tensor
    """[P, K] A(y), one per outcome (a per-sample advantage)."""

    def probability(self, log: torch.Tensor) -> torch.Tensor:
        """[P, K] the outcome's probability: Π_t of the tokens'."""
        return log.sum(-1).exp()


def documented(value: torch.Tensor, gradient_of: torch.Tensor) -> torch.Tensor:
    """A scalar with ``value``'s value and ``gradient_of``'s gradient."""
    return value.detach() + (gradient_of - gradient_of.detach())


def _clip_bounds(config: Any) -> tuple[float, float]:
    high = config.eps_clip_high if config.eps_clip_high is not None else config.eps_clip
    return 1 - config.eps_clip, 1 + high


def _clip(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.minimum(torch.maximum(x, torch.full_like(x, low)), torch.full_like(x, high))


def ppo_tokens(p: Policies, config: Any) -> torch.Tensor:
    advantage = p.advantages[..., None]
    ratio = torch.exp(p.log_pi - p.log_old)
    low, high = _clip_bounds(config)
    loss = torch.maximum(-advantage * ratio, -advantage * _clip(ratio, low, high))
    if config.dual_clip_c is not None:
        loss = torch.where(advantage < 0,
                           torch.minimum(loss, -advantage * config.dual_clip_c), loss)
    return loss


def _sequence_ratio(p: Policies) -> torch.Tensor:
    return torch.exp((p.log_pi - p.log_old).mean(-1, keepdim=True))  # [P, K, 1]


def gspo_tokens(p: Policies, config: Any) -> torch.Tensor:
    advantage = p.advantages[..., None]
    token_form = _sequence_ratio(p).detach() * torch.exp(p.log_pi - p.log_pi.detach())
    low, high = _clip_bounds(config)
    return torch.maximum(-advantage * token_form, -advantage * _clip(token_form, low, high))


def gspo_sequence_objective(p: Policies, config: Any) -> torch.Tensor:
    """GSPO's own objective (Zheng et al. 2025): E_μ[max(−A·s, −A·clip(s))] over sequences."""
    ratio, low, high = _sequence_ratio(p)[..., 0], *_clip_bounds(config)
    loss = torch.maximum(-p.advantages * ratio, -p.advantages * _clip(ratio, low, high))
    return (p.probability(p.log_mu) * loss).sum()


def cispo_tokens(p: Policies, config: Any) -> torch.Tensor:
    ratio = torch.exp(p.log_pi - p.log_old).detach()
    cap = _clip_bounds(config)[1]
    return -torch.minimum(ratio, torch.full_like(ratio, cap)) * p.advantages[..., None] * p.log_pi


def importance_sampling_tokens(p: Policies, config: Any) -> torch.Tensor:
    return -p.advantages[..., None] * torch.exp(p.log_pi - p.log_mu)


def cross_entropy_tokens(p: Policies, config: Any) -> torch.Tensor:
    return -p.log_pi


def policy_gradient(p: Policies) -> torch.Tensor:
    """−Σ_y π(y)·A(y): the policy gradient theorem's objective, value and gradient."""
    return -(p.probability(p.log_pi) * p.advantages).sum()


def importance_sampling_objective(p: Policies, config: Any) -> torch.Tensor:
    """Unbiased off-policy: E_μ[−A·π/μ] = −Σ_y π(y)·A(y) exactly (L = 1)."""
    return policy_gradient(p)


@dataclass(frozen=True)
class PolicyFormula:
    """One policy loss's documented formula."""

    tokens: Callable[[Policies, Any], torch.Tensor]
    """ℓ_t [P, K, L] per token of every outcome, sg as documented."""
    sequence_level: bool = False
    """Its ℓ reads the whole sample (checked on outcomes of 2 tokens, not 1)."""
    policy_gradient: bool = True
    """At ρ = 1 its expected gradient is the policy gradient theorem's."""
    off_policy: Callable[[Policies, Any], torch.Tensor] | None = None
    """The paper's own expected objective off-policy (no correction), when it has one."""
    correction: str | None = "old_policy"
    """How a rollout correction applies: ``old_policy`` (ℓ ← sg(W)·ℓ), ``own_ratio``
    (its ratio is to μ: W replaces it), None (never corrected)."""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Extra rows: name -> config fields (e.g. the dual clip)."""


POLICY_FORMULAS: dict[str, PolicyFormula] = {
    "ppo": PolicyFormula(ppo_tokens, variants={"dual-clip": {"dual_clip_c": 2.0}}),
    "gspo": PolicyFormula(gspo_tokens, sequence_level=True, off_policy=gspo_sequence_objective),
    "cispo": PolicyFormula(cispo_tokens),
    "importance_sampling": PolicyFormula(importance_sampling_tokens,
                                         off_policy=importance_sampling_objective,
                                         correction="own_ratio"),
    "cross_entropy": PolicyFormula(cross_entropy_tokens, policy_gradient=False, correction=None),
}
"""The documented formula of each built-in policy loss, by its registry name."""


def correction_weight(p: Policies, level: str, mode: str, low: float, high: float,
                      behaviour: torch.Tensor) -> torch.Tensor:
    """W [P, K, L] (no graph) of δ = log π_b − log μ at ``level``, truncated or masked."""
    delta = (behaviour - p.log_mu).detach()
    if level == "sequence":
        delta = delta.sum(-1, keepdim=True).expand_as(delta)
    elif level == "geometric":
        delta = delta.mean(-1, keepdim=True).expand_as(delta)
    weight = torch.exp(delta)
    if mode == "truncate":
        return torch.minimum(weight, torch.full_like(weight, high))
    return torch.where((weight >= low) & (weight <= high), weight, 0.0)


def expected_pg(p: Policies, config: Any, formula: PolicyFormula,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """E_{y~μ}[(1/L) Σ_t W_t·ℓ_t(y)] (W = 1 uncorrected); own_ratio: value −A·W_t,
    gradient −A·W_t·∇log π_t (W replaces the ratio to μ)."""
    if weight is not None and formula.correction == "own_ratio":
        value = -p.advantages[..., None] * weight
        tokens = value + value * (p.log_pi - p.log_pi.detach())
    else:
        tokens = formula.tokens(p, config)
        if weight is not None:
            tokens = weight * tokens
    return (p.probability(p.log_mu) * tokens.mean(-1)).sum()


def kl_reverse(p: Policies) -> torch.Tensor:
    return (p.log_pi.exp() * (p.log_pi - p.log_ref)).sum()


def kl_forward(p: Policies) -> torch.Tensor:
    return (p.log_ref.exp() * (p.log_ref - p.log_pi)).sum()


def _k2_value(p: Policies) -> torch.Tensor:
    return (p.log_pi.exp() * 0.5 * (p.log_pi - p.log_ref).square()).sum()


KL_FORMULAS: dict[str, Callable[[Policies], torch.Tensor]] = {
    "k1": lambda p: documented(kl_reverse(p), 0.0 * p.log_pi.sum()),
    "k2": lambda p: documented(_k2_value(p), kl_reverse(p)),
    "k3": lambda p: documented(kl_reverse(p), kl_forward(p)),
    "low_var_kl": lambda p: documented(kl_reverse(p), kl_forward(p)),
    "k3+": kl_reverse,
}
"""docs/loss-aggregation.md's table as a loss term (L = 1, outcomes = the vocabulary):
value E_π[k] and expected gradient E_π[∇k] of each estimator."""


def negative_entropy(p: Policies) -> torch.Tensor:
    """The entropy term's contribution to the objective (a bonus): −H = Σ π log π."""
    return (p.log_pi.exp() * p.log_pi).sum()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               probability: torch.Tensor, value_clip: float | None) -> torch.Tensor:
    """E_μ[½·max((V−R)², (clip(V, V_old−ε, V_old+ε) − R)²)]; [P, K] each (V per context)."""
    squared = (values - returns).square()
    if value_clip is not None:
        clipped = torch.minimum(torch.maximum(values, old_values - value_clip),
                                old_values + value_clip)
        squared = torch.maximum(squared, (clipped - returns).square())
    return (probability * 0.5 * squared).sum()


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor,
                  margin: torch.Tensor | None = None, center: float = 0.0) -> torch.Tensor:
    """−(1/P) Σ log σ(r⁺ − r⁻ − m) + c·(1/P) Σ (r⁺ + r⁻)² (TRL's margin and centring),
    with −log σ(x) = log(1 + e^{−x})."""
    shifted = chosen - rejected - (0.0 if margin is None else margin)
    return (torch.log1p(torch.exp(-shifted)) + center * (chosen + rejected).square()).mean()
