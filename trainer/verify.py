r"""Check that parallel layouts agree, with a check that can fail.

For every layout, aggregation mode and term (pg, KL, entropy) the trainer computes one
step's summed gradient — what the optimizer would see, with no optimizer in the way —
and the term's logged J, and compares them with the first layout's:

    |Δg| ≤ rtol·|g_ref| + atol·‖g_ref‖∞        (elementwise, per parameter tensor)
    |ΔJ| ≤ rtol·|J_ref| + atol·Σ|w·ℓ|_ref      (the term's own magnitude)

so a J that is 0 in exact arithmetic (sample_mean with GRPO advantages at ratio 1) is
judged against its scale, not against itself. The policy starts perturbed away from the
reference model, so KL and its gradient are not zero; each term's gradient is taken on
its own (coefficient 1), so a KL weighting bug cannot hide under a small ``kl_coef``.
FSDP computes in float64 for this; Megatron in fp32 (looser default tolerance).

Packed rows and padded micro-batches are layouts too (``dp1cp1-padded``): the default
reference is one padded rank, so every packed layout is checked against padding. So is
the shared prefix (``dp1cp1-prefix``, ``dp2cp1-prefix``: each group's prompt trained once,
``trainer.shared_prefix``); ``-packed`` packs without sharing, a plain name is the job's.

A rollout with several updates (``updates``: mini-batches × epochs) is compared update by
update: at each update every mode's and term's gradient on its own mini-batch, then the
job's own optimizer step (its configured objective), the same in every layout, so every
update of the rollout is checked, with the old log-probs of the rollout's start.

Under ``trainer.lora`` the gradients compared are the adapters' (the base is frozen), with
the KL reference the base itself, adapters disabled; B is perturbed away from 0 as well.

A job with ``aggregation.custom_reducer`` is checked under one more mode, ``custom``: its
pg term weighted by the reducer's dense [N, S] weights (sliced like the tokens), KL and
entropy by their own modes.

PPO with a critic (``critic.enabled``) adds the critic's term ``value``: the reference
layout's critic gives the rollout's values, GAE over them gives each layout's per-token
advantages (whitened by that layout's reduction of every rank's statistics:
:func:`rank_token_moments`) and the critic's returns; the policy's terms are compared on
those advantages, then the critic's value-loss gradient and J under every mode, update by
update, on its own ranks (trainer/backends/fsdp/critic.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from rollout.batch import RolloutBatch
from trainer.config import AGGREGATION_MODES, AggregationConfig, ObjectiveConfig, TrainerConfig
from trainer.micro_batch import slice_for_plan
from trainer.mini_batches import Update, mini_batch
from trainer.planted import NOTHING_PLANTED, Planted
from trainer.step_plan import StepPlan
from trainer.terms import POLICY_TERMS, terms_of
from trainer.verify_pool import OnStart, RankPool, run_order

TERMS = {term.name: term.logged for term in POLICY_TERMS}
"""Policy term (trainer/terms.py) -> its logged J."""
CRITIC_TERMS = {term.name: term.logged for term in terms_of("value")}
"""The critic's term (trainer/value_loss.py) -> its logged J."""
CUSTOM_MODE = "custom"
"""The mode of the rows that check the job's own ``aggregation.custom_reducer``."""


@dataclass(frozen=True)
class Layout:
    dp_size: int
    cp_size: int
    packed: bool | None = None
    """Packed rows or padded micro-batches; None: the job's ``trainer.packing``."""
    shared_prefix: bool | None = None
    """Packed rows sharing each group's prompt; None: the job's (or off when ``packed``
    is set: ``-packed`` packs without sharing)."""

    def __post_init__(self) -> None:
        if self.packed is not None and self.shared_prefix is None:  # -packed shares nothing
            object.__setattr__(self, "shared_prefix", False)

    STYLES: ClassVar[dict[str, tuple[bool | None, bool | None]]] = {
        "": (None, None), "packed": (True, False), "padded": (False, False),
        "prefix": (True, True)}
    """Name suffix -> (packed, shared_prefix)."""

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'dp2cp1' -> Layout(2, 1); 'dp1cp1-padded', 'dp2cp2-packed', 'dp2cp1-prefix'
        force the layout."""
        shape, _, style = text.lower().partition("-")
        try:
            packed, shared = cls.STYLES[style]
            dp, cp = shape.removeprefix("dp").split("cp")
            layout = cls(int(dp), int(cp), packed, shared)
        except (KeyError, ValueError) as err:
            raise ValueError(f"layouts: expected entries like 'dp2cp1', 'dp1cp1-padded' or "
                             f"'dp1cp1-prefix', got {text!r}") from err
        if shared and layout.cp_size > 1:
            raise ValueError(f"layouts: {text}: a shared prefix needs trainer.cp_size 1")
        return layout

    def __str__(self) -> str:
        style = next(name for name, value in self.STYLES.items()
                     if value == (self.packed, self.shared_prefix))
        return f"dp{self.dp_size}cp{self.cp_size}{'-' if style else ''}{style}"


@dataclass(frozen=True)
class TermResult:
    value: float
    magnitude: float
    gradients: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Row:
    """One (layout, mode, update, term) comparison against the reference layout."""

    layout: str
    mode: str
    update: int
    term: str
    grad_abs: float
    grad_rel: float
    value_abs: float
    value_rel: float
    ok: bool


def default_tolerance(config: TrainerConfig) -> tuple[float, float]:
    """(rtol, atol): float64 on FSDP leaves ~1e-15 of rounding; fp32 on Megatron ~1e-6."""
    return (1e-7, 1e-7) if config.backend == "fsdp" else (1e-4, 1e-4)


def verification_config(config: TrainerConfig) -> TrainerConfig:
    """The job's trainer in float64 where the backend allows, with a reference model."""
    loss = config.loss.model_copy(update={"kl_coef": config.loss.kl_coef or 1.0})
    update: dict[str, object] = {"loss": loss}
    if config.lora is not None:  # dropout would draw other masks in every layout
        update["lora"] = config.lora.model_copy(update={"dropout": 0.0})
    if config.backend == "fsdp":
        update["dtype"] = "float64"
    return config.model_copy(update=update)


def checked_modes(objective: ObjectiveConfig) -> tuple[str, ...]:
    """Every built-in mode, and ``custom`` when the job's pg term has a custom reducer."""
    return (*AGGREGATION_MODES, *((CUSTOM_MODE,) if objective.pg.custom_reducer else ()))


def mode_objectives(objective: ObjectiveConfig, modes: tuple[str, ...],
                    terms: tuple[str, ...] = tuple(TERMS)
                    ) -> list[tuple[str, str, ObjectiveConfig]]:
    """(mode, term, the objective whose gradient is that term's under that pg mode) for
    every mode and term; ``custom`` keeps the job's own pg aggregation (its reducer). The
    critic's one term (``value``) is its whole objective (``gradient_of`` all)."""
    checked = []
    for mode in modes:
        if mode == CUSTOM_MODE:
            if objective.pg.custom_reducer is None:
                raise ValueError("modes: 'custom' needs aggregation.custom_reducer")
            pg = objective.pg
        else:
            pg = AggregationConfig(mode=mode, divisor=objective.metric_divisor
                                   if mode == "constant" else None)
        checked += [(mode, term, objective.model_copy(update={
            "pg": pg, "gradient_of": term if term in TERMS else "all"})) for term in terms]
    return checked


@dataclass(frozen=True)
class CriticCheck:
    """The critic's part of a verification (PPO with a critic): its group's trainer
    config and objective, model, value clip, and each layout's rollout batch (GAE over
    the reference critic's values, whitened by that layout's reduction: a test may plant
    per-rank statistics there)."""

    config: TrainerConfig
    objective: ObjectiveConfig
    model_path: str
    value_clip: float | None
    batch_for_layout: Callable[[Layout, torch.Tensor], RolloutBatch]
    """(layout, the reference critic's values [N, S]) -> the batch that layout trains."""


def rank_token_moments(batch: RolloutBatch, plan: StepPlan, cp_size: int) -> torch.Tensor:
    """[dp, cp, 3]: (n, Σ A, Σ A²) of the advantages over the valid tokens each DP × CP
    rank holds under ``plan`` (its micro-batches, shifted and cut to its CP shard): the
    statistics a whitening reduces over every rank. Summed over the ranks they are the
    whole rollout's, exactly once per token."""
    out = torch.zeros(len(plan.micro_batches), cp_size, 3, dtype=torch.float64)
    for dp_rank, micro_batches in enumerate(plan.micro_batches):
        for samples in micro_batches:
            for cp_rank in range(cp_size):
                micro = slice_for_plan(batch, plan, samples, cp_size, cp_rank)
                valid = micro.loss_mask > 0
                x = micro.advantages.double()[valid]
                out[dp_rank, cp_rank] += torch.stack([
                    torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(),
                    (x * x).sum()])
    return out


def perturbed(state: dict[str, torch.Tensor], seed: int = 0, scale: float = 0.05
              ) -> dict[str, torch.Tensor]:
    """The policy moved off the reference: each float tensor + scale·std·noise. A tensor
    that is all one value (LoRA's B starts at 0; a norm's weights of 1, a zero bias) gets
    noise of scale / √(its last dim) instead, so an adapter's A has a gradient to compare
    too."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in state.items():
        if value.is_floating_point() and value.numel() > 1:
            noise = torch.randn(value.shape, generator=gen, dtype=torch.float64)
            spread = float(value.double().std()) or value.shape[-1] ** -0.5
            value = (value.double() + scale * spread * noise).to(value.dtype)
        out[name] = value
    return out


def layout_config(config: TrainerConfig, layout: Layout) -> TrainerConfig:
    """The trainer config of ``layout``: its DP and CP sizes, packing and prefix."""
    update: dict[str, object] = {"dp_size": layout.dp_size, "cp_size": layout.cp_size}
    if layout.packed is not None:
        update |= {"packing": layout.packed, "shared_prefix": layout.shared_prefix}
    elif config.shared_prefix and layout.cp_size > 1:  # the job's own, where CP allows
        update["shared_prefix"] = None
    return TrainerConfig.model_validate(config.model_dump() | update)


def run_layout(config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
               batch: RolloutBatch, layout: Layout, modes: tuple[str, ...],
               updates: list[Update], policy_state: dict[str, torch.Tensor] | None = None,
               planted: Planted = NOTHING_PLANTED, critic: CriticCheck | None = None,
               pool: RankPool | None = None,
               ) -> tuple[dict[tuple[str, int, str], TermResult], dict[str, torch.Tensor]]:
    """Every (mode, update, term) gradient and J under one layout, from ``policy_state``
    (the perturbed policy; made from the first layout's weights when None). ``critic``:
    the critic's group instead, its ``value`` term (its fresh head needs no
    perturbation: its values are not the returns). ``planted``: the errors this layout's
    ranks make (a test's; trainer/planted.py), injected into the ranks built here.
    ``pool``: where the ranks come from (trainer/verify_pool.py: a live group of this
    world size rebuilt, its ranks' state fresh); None: a group of their own, stopped
    after."""
    import ray

    from trainer.group import TrainerGroup
    from trainer.worker import TrainerRank

    config = layout_config(config, layout)
    own_pool = pool is None
    pool = RankPool() if pool is None else pool
    terms = CRITIC_TERMS if critic is not None else TERMS
    try:
        group = pool.group(config, objective, model_path, total_steps=len(updates),
                           critic=critic is not None,
                           value_clip=critic.value_clip if critic is not None else None)
        if planted:  # the verify-only verb, before any step (bounded, as every verb)
            group.call_each(TrainerRank.plant, [(planted,)] * len(group.workers))
        if policy_state is None:
            policy_state = ray.get(group.async_export_weights())
            policy_state = policy_state if critic is not None else perturbed(policy_state)
        group.load_weights(policy_state)
        rollout = batch
        if len(updates) > 1 and config.loss.old_log_probs == "trainer" and critic is None:
            assert isinstance(group, TrainerGroup)  # the policy's: it has log-probs
            rollout = batch.with_old_log_probs(group.log_probs(batch))
        checked = mode_objectives(objective, modes, tuple(terms))
        results = {}
        for update in updates:
            mini = mini_batch(rollout, update)
            per_check = group.gradients(mini, [obj for *_, obj in checked])
            for (mode, term, _), (sums, grads) in zip(checked, per_check, strict=True):
                logged = terms[term]
                results[mode, update.index, term] = TermResult(
                    sums[logged], sums[f"magnitude/{term if critic else logged}"], grads)
            if len(updates) > 1:  # the job's own step, the same in every layout
                group.train(mini)
        return results, policy_state
    finally:
        if own_pool:
            pool.close()


def compare(ref: TermResult, got: TermResult, rtol: float, atol: float
            ) -> tuple[float, float, float, float, bool]:
    """(max |Δg|, max over tensors of |Δg|∞/|g_ref|∞, |ΔJ|, |ΔJ|/|J_ref|, within
    tolerance)."""
    grad_abs = grad_rel = 0.0
    ok = True
    for name, g_ref in ref.gradients.items():
        delta = (got.gradients[name] - g_ref).abs()
        scale = float(g_ref.abs().max()) if g_ref.numel() else 0.0
        tensor_abs = float(delta.max()) if delta.numel() else 0.0
        grad_abs = max(grad_abs, tensor_abs)
        grad_rel = max(grad_rel, tensor_abs / scale if scale > 0 else 0.0)  # per tensor
        ok &= bool((delta <= rtol * g_ref.abs() + atol * scale).all())
    value_abs = abs(got.value - ref.value)
    value_rel = value_abs / abs(ref.value) if ref.value else 0.0
    ok &= value_abs <= rtol * abs(ref.value) + atol * ref.magnitude
    return grad_abs, grad_rel, value_abs, value_rel, ok


def verify_layouts(config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                   batch: RolloutBatch, layouts: list[Layout],
                   modes: tuple[str, ...] | None = None,
                   tolerance: tuple[float, float] | None = None,
                   planted: Mapping[str, Planted] | None = None,
                   updates: list[Update] | None = None, critic: CriticCheck | None = None,
                   on_start: OnStart | None = None) -> list[Row]:
    """Rows of (layout, mode, update, term) against the first layout. ``modes``: default
    :func:`checked_modes`; ``updates`` splits the rollout (default: one update on the
    whole batch); ``planted``: {layout name: the errors its ranks make}, a test's
    (trainer/planted.py). ``critic`` (PPO with a critic): the reference
    critic's values make each layout's batch (GAE, its own whitening reduction), and the
    critic's ``value`` term is compared too, after the policy's. The ranks of one role
    and world size are started once and rebuilt for each of its layouts (a
    trainer/verify_pool.py ``RankPool``; ``on_start`` hears of each group it starts)."""
    config = verification_config(config)
    modes = modes or checked_modes(objective)
    rtol, atol = tolerance or default_tolerance(config)
    planted = planted or {}
    unknown = sorted(set(planted) - {str(layout) for layout in layouts})
    if unknown:  # errors planted where nothing runs would let the check pass
        raise ValueError(f"planted: layout(s) {unknown} not among the layouts compared")
    updates = updates or [Update(0, 0, list(range(batch.num_samples)))]
    order = run_order([layout.dp_size * layout.cp_size for layout in layouts])

    def against_reference(pool: RankPool, config: TrainerConfig, objective: ObjectiveConfig,
                          model_path: str, modes: tuple[str, ...],
                          batch_of: Callable[[Layout], RolloutBatch],
                          critic: CriticCheck | None = None) -> list[Row]:
        """Every later layout's (mode, update, term) against the first layout's, from
        the first layout's weights; run in :func:`run_order`, listed in the given one."""
        reference: dict[tuple[str, int, str], TermResult] = {}
        state: dict[str, torch.Tensor] | None = None
        rows: dict[int, list[Row]] = {}
        for index in order:
            layout = layouts[index]
            got, state = run_layout(config, objective, model_path, batch_of(layout), layout,
                                    modes, updates, state,
                                    planted.get(str(layout), NOTHING_PLANTED), critic, pool)
            if index == 0:
                reference = got
                continue
            rows[index] = [Row(str(layout), mode, update, term,
                               *compare(reference[mode, update, term], result, rtol, atol))
                           for (mode, update, term), result in got.items()]
        return [row for index in range(1, len(layouts)) for row in rows[index]]

    with RankPool(on_start) as pool:
        critic_rows: list[Row] = []
        batches = {str(layout): batch for layout in layouts}
        if critic is not None:  # first: the reference critic's group serves its layout too
            critic_config = verification_config(critic.config).model_copy(
                update={"loss": critic.config.loss})  # no reference model for a critic
            values = critic_values(critic_config, critic, layouts[0], batch, pool)
            batches = {str(layout): critic.batch_for_layout(layout, values)
                       for layout in layouts}
            trained = batches[str(layouts[0])]  # the returns do not depend on the whitening
            critic_rows = against_reference(
                pool, critic_config, critic.objective, critic.model_path,
                tuple(m for m in modes if m != CUSTOM_MODE), lambda _: trained, critic)
        rows = against_reference(pool, config, objective, model_path, modes,
                                 lambda layout: batches[str(layout)])
    return rows + critic_rows


def critic_values(config: TrainerConfig, critic: CriticCheck, layout: Layout,
                  batch: RolloutBatch, pool: RankPool | None = None) -> torch.Tensor:
    """The critic's values [N, S] of the rollout ``batch`` under ``layout`` (no update),
    from ``pool``'s ranks (None: a group of its own, stopped after)."""
    from trainer.group import CriticGroup

    with RankPool() if pool is None else contextlib.nullcontext(pool) as ranks:
        group = ranks.group(layout_config(config, layout), critic.objective,
                            critic.model_path, total_steps=1, critic=True,
                            value_clip=critic.value_clip)
        assert isinstance(group, CriticGroup)  # the pool's critic group
        return group.values(batch)


def format_rows(rows: list[Row]) -> list[str]:
    """The table the CLI prints: absolute and relative differences per row."""
    lines = [f"{'layout':<13} {'mode':<12} {'update':>6} {'term':<8} {'|Δgrad|':>9} {'rel':>9} "
             f"{'|ΔJ|':>9} {'rel':>9}  result"]
    lines += [f"{r.layout:<13} {r.mode:<12} {r.update:>6} {r.term:<8} {r.grad_abs:>9.1e} "
              f"{r.grad_rel:>9.1e} {r.value_abs:>9.1e} {r.value_rel:>9.1e}  "
              f"{'ok' if r.ok else 'FAIL'}" for r in rows]
    return lines
