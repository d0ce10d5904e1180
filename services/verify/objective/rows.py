r"""The rows of ``tally verify-objective``: one per term and variant, each production's exact
expected J and ∇J (production.py) against the documented formula's (formulas.py).

    pg/<loss> on-policy      ρ = 1, samples from π: the policy gradient theorem
    pg/<loss> off-policy     samples from π_old ≠ π (an update after the first)
    pg/<loss> <variant>      e.g. ppo's dual clip, off-policy
    correction/<level>-<mode> <loss>   engine μ ≠ π_old, the rollout correction's weight
    correction/tis_cap ppo   the legacy spelling
    kl/<estimator>           samples from π, the reference π_ref
    entropy
    value clip=ε, value unclipped, bt, bt margin+centring

Each policy row is taken at every temperature the check runs (the worst error counts).
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from services.verify.objective import formulas
from services.verify.objective.formulas import POLICY_FORMULAS, Policies, PolicyFormula
from services.verify.objective.production import (
    Production,
    pair_term,
    policy_objective,
    value_objective,
)
from services.verify.objective.setting import Setting, enumerate_outcomes, outcome_log_probs
from trainer.config import LossConfig
from trainer.losses import POLICY_LOSSES

DEFAULT_CORRECTION_HIGH = 2.0
"""The correction rows' bound when the job sets none (π_old/μ spans about [0.3, 3])."""
PAIR_CENTER = 0.05
"""c of the Bradley–Terry row with TRL's reward centring."""
Reference = Callable[[Policies], torch.Tensor]


@dataclass(frozen=True)
class PolicyCheck:
    """One policy row: the production config and term, and its documented reference."""

    name: str
    term: str
    """The term production isolates (``gradient_of``): pg, kl or entropy."""
    family: str
    """What the row checks, for the planted errors' tests: pg, correction, kl, entropy."""
    loss: LossConfig
    length: int
    situation: str
    """on-policy (μ = π_old = π), off-policy (μ = π_old ≠ π), corrected (μ ≠ π_old ≠ π)."""
    reference: Reference


def loss_variant(loss: LossConfig, **fields: Any) -> LossConfig:
    """The job's loss settings (only those it set) with ``fields``, no KL or correction
    unless asked (a row isolates one term; kl_coef 0 accepts any estimator)."""
    base = loss.model_dump(exclude_unset=True)
    for name in ("class_path", "kwargs", "tis_cap", "rollout_correction", "dual_clip_c",
                 "kl_placement", "kl_controller", "kl_estimator", "kl_coef",
                 "allow_biased_kl_gradient"):
        base.pop(name, None)
    return LossConfig.model_validate({**base, **fields})


def _corrections(loss: LossConfig, name: str) -> Iterator[tuple[str, dict[str, Any], str,
                                                               str, float, float]]:
    """(row label, config fields, level, mode, low, high) of each correction row: every
    level and mode for one loss of each kind (ppo: old_policy, importance_sampling:
    own_ratio), token truncation for the others, and ppo under the legacy tis_cap."""
    job = loss.correction
    high = job.high if job is not None else DEFAULT_CORRECTION_HIGH
    low = job.low if job is not None and job.low is not None else 1 / high
    all_kinds = name in ("ppo", "importance_sampling")
    for level in ("token", "sequence", "geometric") if all_kinds else ("token",):
        for mode in ("truncate", "mask") if all_kinds else ("truncate",):
            fields = {"level": level, "mode": mode, "high": high,
                      **({"low": low} if mode == "mask" else {})}
            yield (f"{level}-{mode}", {"rollout_correction": fields}, level, mode,
                   low if mode == "mask" else 0.0, high)
    if name == "ppo":
        yield "tis_cap", {"tis_cap": high}, "token", "truncate", 0.0, high


def _on_policy_reference(formula: PolicyFormula, loss: LossConfig, length: int) -> Reference:
    if not formula.policy_gradient:
        return lambda p: formulas.expected_pg(p, loss, formula)
    # the value as documented (cispo's is not −Σπ·A), the gradient the policy gradient
    # theorem's, ÷L for a length-normalised (sequence) ratio
    return lambda p: formulas.documented(formulas.expected_pg(p, loss, formula),
                                         formulas.policy_gradient(p) / length)


def _correction_reference(config: LossConfig, formula: PolicyFormula, level: str, mode: str,
                          low: float, high: float) -> Reference:
    def reference(p: Policies) -> torch.Tensor:
        behaviour = p.log_old if formula.correction == "old_policy" else p.log_pi
        weight = formulas.correction_weight(p, level, mode, low, high, behaviour)
        return formulas.expected_pg(p, config, formula, weight)
    return reference


def loss_checks(loss: LossConfig, name: str, formula: PolicyFormula) -> list[PolicyCheck]:
    """The rows of one policy loss: on- and off-policy, its variants, its corrections."""
    length = 2 if formula.sequence_level else 1
    plain = loss_variant(loss, policy_loss=name)
    off = formula.off_policy or (lambda p, c: formulas.expected_pg(p, c, formula))
    checks = [
        PolicyCheck(f"pg/{name} on-policy", "pg", "pg", plain, length, "on-policy",
                    _on_policy_reference(formula, plain, length)),
        PolicyCheck(f"pg/{name} off-policy", "pg", "pg", plain, length, "off-policy",
                    lambda p: off(p, plain))]
    for variant, fields in formula.variants.items():
        # the job's own value of a variant's field when it sets one
        config = loss_variant(loss, policy_loss=name, **{
            key: getattr(loss, key) if getattr(loss, key) is not None else value
            for key, value in fields.items()})
        checks.append(PolicyCheck(
            f"pg/{name} {variant} off-policy", "pg", "pg", config, length, "off-policy",
            lambda p, c=config: formulas.expected_pg(p, c, formula)))
    if formula.correction is not None:
        for label, fields, level, mode, low, high in _corrections(loss, name):
            config = loss_variant(loss, policy_loss=name, **fields)
            checks.append(PolicyCheck(
                f"correction/{label} {name}", "pg", "correction", config,
                max(length, 1 if level == "token" else 2), "corrected",
                _correction_reference(config, formula, level, mode, low, high)))
    return checks


def policy_checks(loss: LossConfig, echo: Callable[[str], None]) -> list[PolicyCheck]:
    """Every policy-side row, iterating production's registries (a policy loss or KL
    estimator without a documented formula here is skipped with a note)."""
    checks = []
    if loss.policy_loss not in POLICY_LOSSES:  # custom: the user's class documents itself
        echo(f"note: the job's policy loss {loss.policy_loss!r} ({loss.class_path}) has no "
             "documented formula here; the built-in losses are checked instead")
    for name in POLICY_LOSSES:
        formula = POLICY_FORMULAS.get(name)
        if formula is None:
            echo(f"note: policy loss {name!r} has no documented formula in "
                 "services/verify/objective/formulas.py; skipped")
            continue
        checks.extend(loss_checks(loss, name, formula))
    estimators = typing.get_args(LossConfig.model_fields["kl_estimator"].annotation)
    for estimator in estimators:
        kl = formulas.KL_FORMULAS.get(estimator)
        if kl is None:
            echo(f"note: kl estimator {estimator!r} has no documented expected gradient in "
                 "services/verify/objective/formulas.py; skipped")
            continue
        checks.append(PolicyCheck(f"kl/{estimator}", "kl", "kl",
                                  loss_variant(loss, kl_estimator=estimator), 1,
                                  "on-policy", kl))
    checks.append(PolicyCheck("entropy", "entropy", "entropy", loss_variant(loss), 1,
                              "on-policy", formulas.negative_entropy))
    return checks


def _gradients(value: torch.Tensor, parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    # the rows share the policy's forwards (Setting's cache): keep their graphs
    grads = torch.autograd.grad(value, parameters, allow_unused=True, retain_graph=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                      for p, g in zip(parameters, grads, strict=True)])


def compare(production: torch.Tensor, reference: torch.Tensor,
            parameters: list[torch.nn.Parameter]) -> tuple[float, float, float, float]:
    """(J_reference, max |∇reference|, max |∇production − ∇reference|,
    |J_production − J_reference|)."""
    reference_grad = _gradients(reference, parameters)
    gap = (_gradients(production, parameters) - reference_grad).abs().max()
    return (float(reference.detach()), float(reference_grad.abs().max()), float(gap),
            float((production - reference).detach().abs()))


def run_policy_check(check: PolicyCheck, setting: Setting, production: Production,
                     temperature: float) -> tuple[float, float, float, float]:
    """One policy row at one temperature: :func:`compare`'s four numbers."""
    length = check.length
    outcomes = enumerate_outcomes(setting.contexts, length)
    log_pi = setting.outcome_log_probs("policy", length, temperature)
    old, engine, ref = (setting.outcome_log_probs(name, length, temperature)
                        for name in ("old", "engine", "reference"))
    if check.situation == "on-policy":
        old = mu = log_pi.detach()
    else:
        mu = old if check.situation == "off-policy" else engine
    if check.loss.old_log_probs == "rollout":  # the ratio's denominator is the engine's
        old = mu
    advantages = setting.data(mu.shape[:2], salt=length)
    policies = Policies(log_pi, old, mu, ref, advantages)
    produced = policy_objective(
        production, setting, outcomes, check.loss, check.term, temperature,
        sampling=mu.reshape(-1, length), advantages=advantages.reshape(-1),
        old_model=None if check.situation == "on-policy" else "old")
    return compare(produced, check.reference(policies), list(setting.policy.parameters()))


def run_value_check(setting: Setting, production: Production, temperature: float,
                    value_clip: float | None) -> tuple[float, float, float, float]:
    """The critic's clipped value loss over one-token outcomes sampled from π."""
    contexts = setting.contexts
    outcomes = enumerate_outcomes(contexts, 1)
    with torch.no_grad():
        probability = outcome_log_probs(setting.policy, contexts, 1, temperature)[..., 0].exp()
    values = setting.critic(contexts).logits[:, -1, 0].double()[:, None].expand_as(probability)
    old_values = values.detach() + setting.data(values.shape[:1], salt=21, std=0.3)[:, None]
    returns = values.detach() + setting.data(values.shape, salt=22, std=0.5)
    produced = value_objective(production, setting, outcomes, probability.reshape(-1),
                               returns.reshape(-1), old_values.reshape(-1), value_clip)
    reference = formulas.value_loss(values, old_values, returns, probability, value_clip)
    return compare(produced, reference, list(setting.critic.parameters()))


def run_pair_check(setting: Setting, production: Production, with_margin: bool
                   ) -> tuple[float, float, float, float]:
    """Bradley–Terry over every pair of one-token outcomes of a context, the one with the
    higher hidden utility chosen; ``with_margin``: a margin per pair and centring
    (c = ``PAIR_CENTER``) too."""
    outcomes = enumerate_outcomes(setting.contexts, 1)
    utility = setting.data((outcomes.num_rows,), salt=31)
    width = outcomes.num_rows // setting.contexts.shape[0]
    pairs = [(i, j) for i in range(outcomes.num_rows) for j in range(outcomes.num_rows)
             if i // width == j // width and utility[i] > utility[j]]
    chosen, rejected = (torch.tensor(side) for side in zip(*pairs, strict=True))
    margin = setting.data((len(pairs),), salt=32, std=0.5) if with_margin else None
    center = PAIR_CENTER if with_margin else 0.0
    produced = pair_term(production, setting, outcomes, chosen, rejected, margin, center)
    scores = setting.critic(outcomes.input_ids).logits[:, -1, 0]
    reference = formulas.bradley_terry(scores[chosen], scores[rejected], margin, center)
    return compare(produced, reference, list(setting.critic.parameters()))
