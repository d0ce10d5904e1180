"""Multi-turn samples: a response [action, observation, action, ...] whose loss mask has
holes (0) on the environment's observation tokens. M_i and T_g count actions only; every
layout (DP 1–3 × CP 1–2, packed and padded, several updates per rollout) gives the float64
reference's J in every mode, the clean objective gives an observation token exactly no
gradient, and the planted ``observation_tokens`` error (holes trained as actions) fails
the layout check."""

from __future__ import annotations

import pytest
import torch

from rollout.batch import RolloutBatch
from rollout.tiny import create_tiny_checkpoint
from trainer.aggregation import AGGREGATION_MODES, aggregate
from trainer.config import (
    AggregationConfig,
    LossConfig,
    ObjectiveConfig,
    OptimizerConfig,
    TermAggregationConfig,
    TrainerConfig,
)
from trainer.losses import kl_penalty, policy_gradient_loss
from trainer.micro_batch import MicroBatch, slice_for_plan
from trainer.mini_batches import mini_batch, rollout_updates
from trainer.objective import (
    LOGGED_SUMS,
    TokenLogProbs,
    _planted_weights,
    micro_batch_objective,
    observation_tokens,
)
from trainer.planted import NOTHING_PLANTED, Planted, PlantedError
from trainer.step_plan import MODE_METRIC_PREFIX, plan_step

MAX_RESPONSE_LEN = 16
OBSERVATION_TOKENS: Planted = frozenset({PlantedError.OBSERVATION_TOKENS})
LOSS = LossConfig(kl_coef=0.1, entropy_coef=0.01, old_log_probs="rollout",
                  kl_aggregation=TermAggregationConfig(mode="prompt_mean"),
                  entropy_aggregation=TermAggregationConfig(mode="token_mean"))
"""KL and entropy under modes of their own, so every term is checked beside pg's modes."""
OBJECTIVE = ObjectiveConfig.compose(AggregationConfig(), LOSS, MAX_RESPONSE_LEN, 0.7)
MODE_NAMES = [MODE_METRIC_PREFIX + mode for mode in AGGREGATION_MODES]


def multi_turn_batch(vocab_size: int, num_prompts: int = 4, group_size: int = 2,
                     seed: int = 0, per_token: bool = False
                     ) -> tuple[RolloutBatch, list[list[float]]]:
    """Whole groups of multi-turn responses with uneven lengths: 1–3 actions of 1–4
    tokens, an observation of 1–3 tokens (mask 0, rollout log-prob 0) between two
    actions; sample 0 has three actions, sample 1 only an observation (no valid token),
    sample 2 ends on an observation (after its last action: not a hole). ``per_token``:
    action tokens weighted 1, 0.5 or 0.25 (fractional m_it) and an advantage per token
    (differing within a sample, values at the holes too), else 1 and one per sample.
    Returns the batch and each response's mask."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    prompts, responses, log_probs, masks, groups = [], [], [], [], []
    for g in range(num_prompts):
        prompt = torch.randint(3, vocab_size, (randint(2, 5),), generator=gen).tolist()
        for _ in range(group_size):
            i = len(prompts)
            num_actions = 3 if i == 0 else 0 if i == 1 else randint(1, 3)
            mask: list[float] = []
            for a in range(num_actions):
                mask += [0.0] * (randint(1, 3) if a else 0) + [
                    (1.0, 0.5, 0.25)[randint(0, 2)] if per_token else 1.0
                    for _ in range(randint(1, 4))]
            if i in (1, 2):
                mask += [0.0] * randint(2, 3)
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab_size, (len(mask),), generator=gen).tolist())
            log_probs.append([-float(torch.rand(1, generator=gen)) * 3 * (m > 0)
                              for m in mask])
            masks.append(mask)
            groups.append(g)
    rewards = torch.rand(len(prompts), generator=gen)
    advantages = ([(torch.randn(len(r), generator=gen)).tolist() for r in responses]
                  if per_token else (rewards - rewards.mean()).tolist())
    batch = RolloutBatch.from_samples(prompts, responses, log_probs, rewards.tolist(),
                                      advantages, groups, group_size, response_masks=masks)
    return batch, masks


def hole_table(batch: RolloutBatch) -> torch.Tensor:
    """[N, S] bool: mask 0 between a sample's first and last valid token."""
    valid = batch.loss_mask > 0
    seen = valid.long().cumsum(-1)
    return ~valid & (seen > 0) & (seen < valid.sum(-1, keepdim=True))


def test_token_counts_and_weights_count_actions_only() -> None:
    """M_i is the sample's action tokens, T_g its group's, and each mode's coefficient is
    built from them; the holes are the observation tokens between two actions."""
    batch, masks = multi_turn_batch(vocab_size=50)
    actions = torch.tensor([sum(m) for m in masks], dtype=torch.float64)
    assert int(actions[1]) == 0 and len(masks[0]) > int(actions[0])  # the test's premises
    assert torch.equal(batch.sample_token_counts, actions)
    assert torch.equal(batch.prompt_mask_sums, actions.view(-1, 2).sum(-1))
    holes = hole_table(batch)
    assert int(holes[0].sum()) >= 2 and not holes[1].any()
    assert int(holes.sum()) < int((batch.loss_mask == 0).sum() - batch.prompt_lengths.sum())
    plan = plan_step(batch, OBJECTIVE, 1, 1, 64)
    n, m = batch.num_samples, actions.double()
    coefficients = plan.coefficients
    expected = torch.where(m > 0, 1 / (n * m.clamp(min=1)), 0.0)
    assert torch.allclose(coefficients[MODE_METRIC_PREFIX + "sample_mean"], expected,
                          rtol=1e-15, atol=0)
    assert torch.allclose(coefficients[MODE_METRIC_PREFIX + "token_mean"],
                          torch.full((n,), 1 / float(m.sum()), dtype=torch.float64),
                          rtol=1e-15, atol=0)
    prompt_totals = m.view(-1, 2).sum(-1).repeat_interleave(2)
    assert torch.allclose(coefficients["kl"], 1 / (batch.num_prompts * prompt_totals),
                          rtol=1e-15, atol=0)


def _token_values(micro: MicroBatch) -> TokenLogProbs:
    """What a backend computing every position (Megatron) would give: the policy's
    log-probs carried in ``old_log_probs`` (values at holes too), an entropy and a
    reference that are functions of them, all float64, log_probs and entropy leaves."""
    policy = micro.old_log_probs.double()
    return TokenLogProbs(policy.clone().requires_grad_(True),
                         (1.5 + 0.25 * policy).clone().requires_grad_(True),
                         0.8 * policy - 0.1)


def _with_policy(batch: RolloutBatch, seed: int = 1) -> RolloutBatch:
    """The batch carrying a policy's log-probs in ``old_log_probs``: off the rollout's on
    actions, a value of its own (≠ 0) on every other response token, holes included."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.rand(batch.loss_mask.shape, generator=gen)
    response = batch.loss_mask > 0
    policy = torch.where(response, batch.rollout_log_probs + 0.4 * (noise - 0.5), -0.5 - noise)
    return batch.with_old_log_probs(policy)


def _oracle(batch: RolloutBatch, objective: ObjectiveConfig) -> dict[str, float]:
    """The terms of one step straight from the formulas (trainer/aggregation.aggregate),
    float64, on the whole [N, S] batch."""
    policy, mask = batch.old_log_probs.double(), batch.loss_mask
    pg = policy_gradient_loss(policy, batch.rollout_log_probs.double(),
                              batch.advantages.double(), LOSS, mask).pg_loss
    kl = kl_penalty(policy, 0.8 * policy - 0.1, LOSS.kl_estimator, mask)
    entropy = 1.5 + 0.25 * policy

    def j(loss: torch.Tensor, term: TermAggregationConfig) -> float:
        return float(aggregate(loss, mask, batch.group_index, term.mode,
                               term.numeric_divisor, group_size=batch.samples_per_prompt))

    values = {MODE_METRIC_PREFIX + mode: j(pg, TermAggregationConfig(
        mode=mode, divisor=objective.mode_metric_divisor if mode == "constant" else None))
        for mode in AGGREGATION_MODES}
    return values | {"pg_loss": j(pg, objective.pg), "kl": j(kl, objective.kl),
                     "entropy": j(entropy, objective.entropy),
                     "valid_tokens": float(mask.sum())}


def _layout_sums(batch: RolloutBatch, objective: ObjectiveConfig, dp: int, cp: int,
                 packed: bool, planted: Planted = NOTHING_PLANTED) -> dict[str, float]:
    """The logged sums of every micro-batch of every DP × CP rank, added up; ``planted``:
    the every-rank errors each rank makes."""
    plan = plan_step(batch, objective, dp, cp, max_tokens_per_micro_batch=20, packed=packed)
    total = torch.zeros(len(LOGGED_SUMS) + len(MODE_NAMES), dtype=torch.float64)
    for rank_micro_batches in plan.micro_batches:
        for samples in rank_micro_batches:
            for cp_rank in range(cp):
                micro = slice_for_plan(batch, plan, samples, cp, cp_rank)
                _, sums = micro_batch_objective(_token_values(micro), micro, LOSS, MODE_NAMES,
                                                planted)
                total += sums
    return dict(zip([*LOGGED_SUMS, *MODE_NAMES], total.tolist(), strict=True))


LAYOUTS = [(dp, cp, packed) for dp in (1, 2, 3) for cp in (1, 2) for packed in (True, False)]


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_every_layout_and_update_gives_the_float64_oracle_with_holes(
        mode: str, per_token: bool) -> None:
    """Every pg mode (KL under prompt_mean, entropy under token_mean), every update of a
    2-step × 2-epoch rollout and DP 1–3 × CP 1–2, packed and padded: the objective's
    logged J of each term, summed over micro-batches and shards, is the formulas' on the
    whole mini-batch, with a policy whose values at the holes are not 0 (as a backend
    that computes every position gives), for one advantage per sample and for advantages
    that differ per token with fractional weights m_it (M_i = Σ_t m_it); planting
    ``observation_tokens`` moves them."""
    objective = ObjectiveConfig.compose(
        AggregationConfig(mode=mode, divisor=5.0 if mode == "constant" else None), LOSS,
        MAX_RESPONSE_LEN, 0.7)
    batch, _ = multi_turn_batch(vocab_size=50, num_prompts=6, group_size=2, seed=2,
                                per_token=per_token)
    updates = rollout_updates(batch, samples_per_step=6, num_epochs=2, seed=0,
                              rollout_index=0)
    assert len(updates) == 4
    for update in updates:
        mini = _with_policy(mini_batch(batch, update), seed=update.index)
        assert hole_table(mini).any()
        oracle = _oracle(mini, objective)
        for dp, cp, packed in LAYOUTS:
            got = _layout_sums(mini, objective, dp, cp, packed)
            for name, value in oracle.items():
                assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-15), (
                    update.index, dp, cp, packed, name)
    planted = _layout_sums(mini, objective, 2, 1, True, OBSERVATION_TOKENS)
    for name in ("pg_loss", "kl", "entropy"):
        assert planted[name] != pytest.approx(oracle[name], rel=1e-6), name
    assert planted["valid_tokens"] == oracle["valid_tokens"] + int(hole_table(mini).sum())


@pytest.mark.parametrize(("packed", "cp"), [(True, 1), (False, 1), (True, 2), (False, 2)])
def test_observation_tokens_get_no_gradient_and_the_planted_error_gives_them_some(
        packed: bool, cp: int) -> None:
    """Clean: ∂J/∂log π and ∂J/∂H are exactly 0 at every mask-0 position (observation,
    prompt, padding) and the sums finite, even with log-probs at the holes far off the
    rollout's 0 (TIS and the dual clip on). Planted: the holes (found in the shard as
    the dataset says they are, CP 1; a subset of them in a CP shard) get the weight of
    their sample's actions in every term, and a gradient."""
    loss = LOSS.model_copy(update={"tis_cap": 2.0, "dual_clip_c": 3.0})
    batch, _ = multi_turn_batch(vocab_size=50, seed=4)
    holes = hole_table(batch)
    batch = _with_policy(batch)
    carrier = batch.with_old_log_probs(holes.float())  # sliced like any per-token tensor
    num_found = 0
    plan = plan_step(batch, OBJECTIVE, 1, cp, max_tokens_per_micro_batch=64, packed=packed)
    for samples in plan.micro_batches[0]:
        for cp_rank in range(cp):
            micro = slice_for_plan(batch, plan, samples, cp, cp_rank)
            expected = slice_for_plan(carrier, plan, samples, cp, cp_rank).old_log_probs > 0
            found, source = observation_tokens(micro)
            num_found += int(found.sum())
            assert not (found & ~expected).any()
            if cp == 1:
                assert torch.equal(found, expected)
            assert (micro.loss_mask.gather(-1, source)[found] == 1).all()
            planted_weights = _planted_weights(micro, frozenset({"observation_tokens"}))
            for term, weights in micro.weights.items():  # the valid token's before it
                assert torch.equal(planted_weights[term][found],
                                   weights.gather(-1, source)[found]), term
                assert torch.equal(planted_weights[term][~found], weights[~found]), term
                assert (planted_weights[term][found] > 0).all(), term
            off = micro.loss_mask == 0
            for planted in (False, True):
                token = _token_values(micro)
                if not planted:  # far off: exp(log π − 0) underflows, a ratio clamps
                    with torch.no_grad():
                        token.log_probs[off] = -1e4
                objective, sums = micro_batch_objective(
                    token, micro, loss, MODE_NAMES,
                    OBSERVATION_TOKENS if planted else NOTHING_PLANTED)
                objective.backward()
                assert torch.isfinite(sums).all() and torch.isfinite(objective)
                grads = (token.log_probs.grad, token.entropy.grad)
                if not planted:
                    for grad in grads:
                        assert torch.isfinite(grad).all()
                        assert (grad[off] == 0).all()
                    assert (grads[1][~off] != 0).all()
                    continue
                assert (grads[0][found] != 0).all() and (grads[1][found] != 0).all()
                assert (grads[1][off & ~found] == 0).all()
    assert (num_found == int(holes.sum())) if cp == 1 else (num_found > 0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


PLANTED = "dp1cp1-packed"
"""The layout whose ranks train the observation tokens (one rank: the cheapest)."""
CLEAN = ("dp2cp2",)
"""Packed DP 2 × CP 2 against padded DP 1: DP, CP and packing in one layout (a layout is
mostly its ranks' start-up, ~5 s each here); the in-process oracle test above has every
DP 1–3 × CP 1–2, packed and padded."""


@pytest.fixture(scope="module")
def verified_rows(ray_cluster: None, tiny_model: str) -> list:
    """One run of the layout check on a multi-turn rollout of 2 updates (mini-batches of
    whole groups, old log-probs of the rollout's start, a real SGD step between them),
    every mode and term, against one padded float64 rank: the clean layouts and the
    planted one side by side, so the reference runs once."""
    from transformers import AutoConfig

    from trainer.verify import Layout, format_rows, verify_layouts

    batch, _ = multi_turn_batch(AutoConfig.from_pretrained(tiny_model).vocab_size,
                                num_prompts=4, group_size=2, seed=3)
    updates = rollout_updates(batch, samples_per_step=4, num_epochs=1, seed=0,
                              rollout_index=0)
    loss = LOSS.model_copy(update={"old_log_probs": "trainer"})
    config = TrainerConfig(loss=loss, max_tokens_per_micro_batch=16,
                           optimizer=OptimizerConfig(type="sgd", lr=0.5, grad_clip=None))
    objective = ObjectiveConfig.compose(AggregationConfig(), loss, MAX_RESPONSE_LEN, 0.7)
    layouts = [Layout.parse(name) for name in ("dp1cp1-padded", *CLEAN, PLANTED)]
    rows = verify_layouts(config, objective, tiny_model, batch, layouts,
                          modes=tuple(AGGREGATION_MODES), updates=updates,
                          planted={PLANTED: OBSERVATION_TOKENS})
    print("\n".join(format_rows(rows)))  # the figures, for -s
    return rows


@pytest.mark.slow  # three layouts on Ray actors
def test_multi_turn_layouts_match_the_float64_reference(verified_rows: list) -> None:
    """Packed DP 2 × CP 2 gives the padded float64 rank's J and ∇J of pg (every mode),
    KL (prompt_mean) and entropy (token_mean) at both updates of the rollout."""
    good = [r for r in verified_rows if r.layout in CLEAN]
    assert {(r.layout, r.mode, r.update, r.term) for r in good} == {
        (lay, m, u, t) for lay in CLEAN for m in AGGREGATION_MODES for u in (0, 1)
        for t in ("pg", "kl", "entropy")}
    assert all(r.ok for r in good), [r for r in good if not r.ok][:3]
    assert max(r.grad_rel for r in good) < 1e-9  # float64: rounding only


@pytest.mark.slow
def test_training_observation_tokens_fails_the_layout_check(verified_rows: list) -> None:
    """The planted ``observation_tokens`` layout fails the pg rows of every mode at both
    updates, in J and in the gradient: the holes' tokens are trained (the FSDP backend
    computes their log-probs then, objective.planted_loss_mask)."""
    failed = {(r.mode, r.update, r.term) for r in verified_rows
              if r.layout == PLANTED and not r.ok}
    assert {(m, u, "pg") for m in AGGREGATION_MODES for u in (0, 1)} <= failed
    pg_rows = [r for r in verified_rows if r.layout == PLANTED and r.term == "pg"]
    assert min(r.grad_rel for r in pg_rows) > 1e-3  # the gradient moved, not only J
