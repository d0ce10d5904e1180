"""The layout verifier on real Ray actors and process groups: packed DP=2 and CP=2 give
the gradients and terms of padded DP=1 for every update of a rollout, mode and term, and
for a custom reducer's dense weights; its tolerance judges a term against its own scale;
the ``verify-aggregation`` program fails (exit code 1) on a ×2 and on each subtle error
planted in it (injected as ``{layout: Planted}``, trainer/planted.py; the README command
passing: tests/services/cli/test_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from services.config.job import load_job_config
from services.runtime.gang import ACTOR_STARTS_ENV
from services.verify.aggregation import parse_layouts, planted_by_layout, verify_aggregation
from services.verify.critic import whitened_for_layout
from tests.trainer.helpers import random_train_batch
from trainer.config import (
    AggregationConfig,
    LossConfig,
    ObjectiveConfig,
    OptimizerConfig,
    TrainerConfig,
)
from trainer.planted import (
    NOTHING_PLANTED,
    PLANTED_ON_EVERY_RANK,
    Planted,
    PlantedError,
    parse_planted,
    rank_planted,
)
from trainer.verify import (
    CUSTOM_MODE,
    Layout,
    TermResult,
    checked_modes,
    compare,
    format_rows,
    mode_objectives,
    perturbed,
    verify_layouts,
)
from trainer.worker import TrainerRank

MODES = ("sample_mean", "token_mean", "prompt_mean", "constant")
ROOT = Path(__file__).resolve().parents[2]
REDUCER = "tests.trainer.reducers:discounted_group_mean"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


CONFIG = TrainerConfig(loss=LossConfig(kl_coef=0.1, entropy_coef=0.01, old_log_probs="rollout"),
                       max_tokens_per_micro_batch=20)
OBJECTIVE = ObjectiveConfig.compose(AggregationConfig(), CONFIG.loss, 8, 0.7)


MULTI_UPDATE_MODES = ("token_mean", "prompt_mean")


@pytest.mark.slow
def test_every_update_of_a_rollout_matches_across_layouts(ray_cluster: None, tiny_model: str
                                                        ) -> None:
    """2 optimizer steps per rollout × 2 epochs: each update's J and ∇J (pg, KL, entropy)
    on its own mini-batch equal padded DP=1's under packed DP=2 and CP=2 with several rows
    per rank (some samples longer than a row), with the rollout's old log-probs and real
    steps in between, with advantages that differ per token and fractional weights m_it.
    Two modes, the two whose normaliser a mini-batch cuts: token_mean
    (the mini-batch's tokens over all ranks) and prompt_mean (its groups); every mode's
    weighting under each layout is checked on one update by the README's command
    (tests/services/cli/test_cli.py) and the planted-error run."""
    from transformers import AutoConfig

    from trainer.mini_batches import rollout_updates

    rollout = random_train_batch(AutoConfig.from_pretrained(tiny_model).vocab_size,
                                 num_prompts=8, group_size=2, seed=3, per_token=True)
    updates = rollout_updates(rollout, samples_per_step=8, num_epochs=2, seed=0,
                              rollout_index=0)
    assert len(updates) == 4
    config = TrainerConfig(
        loss=LossConfig(kl_coef=0.1, entropy_coef=0.01), max_tokens_per_micro_batch=12,
        # clipped: with the default KL (k3+, k2's gradient, linear in δ, where k3's clamp
        # zeroed it past ±MAX_LOG_RATIO) unclipped SGD at lr 0.5 saturates the tiny model by
        # update 3, where float64 rounding alone parts the layouts' KL and entropy gradients
        optimizer=OptimizerConfig(type="sgd", lr=0.5, grad_clip=1.0))
    rows = verify_layouts(config, OBJECTIVE, tiny_model, rollout,
                          [Layout(1, 1, packed=False), Layout(2, 1), Layout(1, 2)],
                          modes=MULTI_UPDATE_MODES, updates=updates)
    assert {(r.mode, r.update) for r in rows} == {
        (m, u) for m in MULTI_UPDATE_MODES for u in range(4)}
    assert len(rows) == 2 * 2 * 4 * 3
    bad = [r for r in rows if not r.ok]
    assert not bad, bad[:3]
    assert max(r.grad_rel for r in rows) < 1e-9  # float64: rounding only


@pytest.mark.slow  # two groups of two ranks on Ray actors
def test_a_rebuilt_group_equals_a_fresh_one_and_keeps_no_planted_error(
        ray_cluster: None, tiny_model: str) -> None:
    """The verifier's pool (trainer/verify_pool.py) rebuilds a live group's ranks in their
    processes for the next layout of the same world size. After a layout that planted
    ×2 on rank 0's pg and every rank's own-token normalisation and took two AdamW steps
    (weights, moments, schedule moved), the same two processes rebuilt as CP=2 give
    exactly, bit for bit, the J and ∇J of a fresh CP=2 group: no weight, optimizer state,
    schedule, process group or planted error of the last layout survives. The planted
    layout did make its errors (its pg rows are far from CP=2's), and the pool started
    one group for both."""
    from transformers import AutoConfig

    from trainer.mini_batches import rollout_updates
    from trainer.verify import layout_config, run_layout, verification_config
    from trainer.verify_pool import RankPool

    rollout = random_train_batch(AutoConfig.from_pretrained(tiny_model).vocab_size,
                                 num_prompts=8, group_size=2, seed=3, per_token=True)
    updates = rollout_updates(rollout, samples_per_step=8, num_epochs=1, seed=0,
                              rollout_index=0)
    assert len(updates) == 2  # an optimizer step between them, in every layout
    config = verification_config(CONFIG.model_copy(
        update={"optimizer": OptimizerConfig(type="adamw", lr=0.05)}))
    modes = ("token_mean",)
    planted = parse_planted("pg,local_tokens")

    def run(layout: Layout, state: dict[str, torch.Tensor] | None, errors: Planted,
            pool: RankPool | None) -> tuple[dict, dict[str, torch.Tensor]]:
        return run_layout(config, OBJECTIVE, tiny_model, rollout, layout, modes, updates,
                          state, errors, pool=pool)

    with RankPool() as pool:
        wrong, state = run(Layout(2, 1, packed=True), None, planted, pool)
        rebuilt, _ = run(Layout(1, 2, packed=True), state, NOTHING_PLANTED, pool)
    assert (pool.groups_started, pool.ranks_started) == ({"policy": 1}, {"policy": 2})
    assert layout_config(config, Layout(1, 2)).world_size == 2
    fresh, _ = run(Layout(1, 2, packed=True), state, NOTHING_PLANTED, None)
    assert rebuilt.keys() == fresh.keys() == {
        ("token_mean", u, t) for u in (0, 1) for t in ("pg", "kl", "entropy")}
    for key, got in rebuilt.items():
        assert (got.value, got.magnitude) == (fresh[key].value, fresh[key].magnitude), key
        assert got.gradients.keys() == fresh[key].gradients.keys()
        for name, grad in got.gradients.items():
            assert torch.equal(grad, fresh[key].gradients[name]), (key, name)
    for update in (0, 1):  # the planted layout made its errors: ×2 on pg is large
        *_, grad_rel, _, _, ok = compare(fresh["token_mean", update, "pg"],
                                         wrong["token_mean", update, "pg"], 1e-7, 1e-7)
        assert not ok and grad_rel > 0.01, (update, grad_rel)


def test_the_pool_runs_each_world_size_together_the_reference_first() -> None:
    """One group per world size: the reference, the rest of its size in their order, then
    each other size, smallest first (the demo's planted-error layouts: sizes 1, 2, 3, 2,
    2 run as 1, 2, 2, 2, 3)."""
    from trainer.verify_pool import run_order

    assert run_order([1, 2, 3, 2, 2]) == [0, 1, 3, 4, 2]
    assert run_order([2, 1, 2, 4, 1]) == [0, 2, 1, 4, 3]
    assert run_order([1]) == [0]


def test_tolerance_scales_with_the_terms_own_magnitude() -> None:
    grads = {"w": torch.tensor([1.0, -2.0])}
    zero_j = TermResult(value=1e-9, magnitude=0.5, gradients=grads)  # J = 0 up to rounding
    noisy = TermResult(value=3e-9, magnitude=0.5, gradients=grads)
    *_, ok = compare(zero_j, noisy, rtol=1e-7, atol=1e-7)
    assert ok  # a relative-only check would see a difference of 2.0 here
    doubled = TermResult(value=1e-9, magnitude=0.5, gradients={"w": torch.tensor([2.0, -2.0])})
    grad_abs, grad_rel, *_, ok = compare(zero_j, doubled, rtol=1e-7, atol=1e-7)
    assert not ok and grad_abs == 1.0 and grad_rel == 0.5


def test_relative_gradient_difference_is_per_tensor() -> None:
    """A tensor's difference is judged against its own scale: 1 off on a tensor of 10 is
    0.1, however small another tensor's gradient."""
    ref = TermResult(value=1.0, magnitude=1.0,
                     gradients={"big": torch.tensor([10.0]), "small": torch.tensor([0.1])})
    got = TermResult(value=1.0, magnitude=1.0,
                     gradients={"big": torch.tensor([11.0]), "small": torch.tensor([0.1])})
    grad_abs, grad_rel, *_, ok = compare(ref, got, rtol=1e-7, atol=1e-7)
    assert (grad_abs, grad_rel, ok) == (1.0, pytest.approx(0.1), False)


def test_perturbation_moves_the_policy_off_the_reference() -> None:
    state = {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(0)),
             "step": torch.tensor(3)}
    moved = perturbed(state)
    assert not torch.equal(moved["w"], state["w"])
    assert torch.equal(moved["step"], state["step"])
    assert torch.equal(perturbed(state)["w"], moved["w"])  # seeded: every layout the same


def test_layout_names_say_packed_or_padded() -> None:
    assert Layout.parse("dp2cp1") == Layout(2, 1)
    assert Layout.parse("dp1cp1-padded") == Layout(1, 1, packed=False)
    assert str(Layout.parse("DP1CP2-packed")) == "dp1cp2-packed"
    assert Layout.parse("dp2cp1-prefix") == Layout(2, 1, packed=True, shared_prefix=True)
    assert str(Layout(2, 1, packed=True, shared_prefix=True)) == "dp2cp1-prefix"
    with pytest.raises(ValueError, match=r"trainer\.cp_size"):
        Layout.parse("dp1cp2-prefix")
    with pytest.raises(ValueError, match="dp1cp1-padded"):
        Layout.parse("dp1cp1-ragged")


def test_custom_mode_checks_the_jobs_own_reducer() -> None:
    """The ``custom`` rows take the gradient of the job's own pg aggregation (its reducer),
    not of a built-in mode; a job without a reducer has no such rows."""
    custom = ObjectiveConfig.compose(AggregationConfig(custom_reducer=REDUCER), CONFIG.loss,
                                     8, 0.7)
    assert checked_modes(OBJECTIVE) == MODES
    assert checked_modes(custom) == (*MODES, CUSTOM_MODE)
    checked = mode_objectives(custom, (CUSTOM_MODE, "token_mean"))
    assert [(mode, term) for mode, term, _ in checked] == [
        (m, t) for m in (CUSTOM_MODE, "token_mean") for t in ("pg", "kl", "entropy")]
    for mode, term, objective in checked:
        assert objective.gradient_of == term
        assert objective.pg.custom_reducer == (REDUCER if mode == CUSTOM_MODE else None)
        assert (objective.kl, objective.entropy) == (custom.kl, custom.entropy)
    with pytest.raises(ValueError, match="custom_reducer"):
        mode_objectives(OBJECTIVE, (CUSTOM_MODE,))


@pytest.mark.slow  # four layouts on Ray actors
def test_custom_reducer_is_exact_under_every_layout_and_a_planted_error_fails(
        ray_cluster: None, tiny_model: str) -> None:
    """The dense-weights path: a reducer whose weights depend on the token's position and
    its whole group gives padded DP=1's J and ∇J in float64 under padded DP=2 (the weights
    split by sample across ranks) and packed CP=2 (sliced by zigzag shard inside packed
    rows), several rows per rank; one wrong coefficient (×1.001, one sample of the only
    rank's packed rows: ``shard_coefficient``) in an extra layout fails every term."""
    from transformers import AutoConfig

    batch = random_train_batch(AutoConfig.from_pretrained(tiny_model).vocab_size,
                               num_prompts=4, group_size=2, seed=5)
    objective = ObjectiveConfig.compose(AggregationConfig(custom_reducer=REDUCER),
                                        CONFIG.loss, 8, 0.7)
    clean = [Layout(2, 1, packed=False), Layout(1, 2, packed=True)]
    planted = Layout(1, 1, packed=True)
    rows = verify_layouts(CONFIG, objective, tiny_model, batch,
                          [Layout(1, 1, packed=False), *clean, planted], modes=(CUSTOM_MODE,),
                          planted={str(planted): frozenset({PlantedError.SHARD_COEFFICIENT})})
    assert {(r.layout, r.term) for r in rows} == {
        (str(layout), term) for layout in (*clean, planted) for term in ("pg", "kl", "entropy")}
    assert {r.mode for r in rows} == {CUSTOM_MODE}
    print("\n".join(format_rows(rows)))  # the figures, for -s
    good = [r for r in rows if r.layout != str(planted)]
    assert all(r.ok for r in good), [r for r in good if not r.ok]
    assert max(r.grad_rel for r in good) < 1e-9  # float64: rounding only
    bad = [r for r in rows if r.layout == str(planted)]
    assert not any(r.ok for r in bad), bad
    assert all(1e-7 < r.grad_rel < 1e-2 for r in bad), bad  # small, and still caught


PLANTS: dict[str, Planted] = {
    "dp2cp1-packed": parse_planted("pg,kl,entropy_coefficient"),
    "dp3cp1": parse_planted("local_tokens"), "dp1cp2": parse_planted("shard_coefficient"),
    "dp2cp1-prefix": parse_planted("prefix_mask")}
"""Layout -> the planted errors its ranks make (trainer/planted.py)."""


def _verified(config: str, layouts: str, overrides: list[str],
              planted: dict[str, Planted]) -> tuple[int, str]:
    """(exit code, output) of the verify-aggregation program, ``planted`` injected."""
    lines: list[str] = []
    code = verify_aggregation(load_job_config(ROOT / "configs" / config, overrides),
                              parse_layouts(layouts), planted=planted, echo=lines.append)
    output = "\n".join(lines)
    print(output)  # the figures, for -s
    return code, output


@pytest.mark.slow  # the demo's warm start and four layouts on Ray actors
def test_verify_aggregation_exits_1_on_each_planted_error(
        ray_cluster: None, shared_data_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One run of the README's command (demo.yaml, a 16-sample rollout, one micro-batch per
    rank), each planted error in a layout of its own against padded DP=1; the command
    exits 1 on any failed row, and each layout's rows fail where its error is:

    - ``pg,kl`` (rank 0 of DP=2 doubles its pg and KL weights) with
      ``entropy_coefficient`` (one sample's entropy coefficient ×1.001) in the same layout:
      the pg and KL rows of every mode far off (relative gradient difference > 1 %), the
      entropy rows by less than 1 %: each error exactly in its own terms.

    - ``local_tokens`` (each rank normalises by its own tokens, then the ranks are
      averaged): 16 samples cannot split evenly over 3 ranks, so the sample_mean KL and
      entropy terms (demo.yaml's mode for them, whatever the pg row's mode) are off.
    - ``shard_coefficient`` (one sample's coefficient ×1.001 in CP rank 0's shard): KL and
      entropy in every row, by less than 1 %.
    - ``prefix_mask`` (shared prefix: a response also sees its head's copy of the last
      prompt token): the log-probs of every response but the group's first move, so every
      row fails.

    ``pg,kl`` is planted in ``-packed`` (no sharing): a shared prefix balances whole groups
    over the ranks, and a rank holding only groups with equal rewards has no pg gradient
    to double.
    """
    starts = tmp_path / "actor_starts"
    monkeypatch.setenv(ACTOR_STARTS_ENV, str(starts))
    code, output = _verified("demo.yaml", ",".join(["dp1cp1-padded", *PLANTS]),
                             ["rollout.global_batch_size=16"], PLANTS)
    assert code == 1, output
    # one group per world size (1, 2, 3), rebuilt for dp1cp2 and dp2cp1-prefix: 6 policy
    # ranks started where a group per layout started 1 + 2 + 3 + 2 + 2 = 10
    assert starts.read_text().splitlines().count("policy") == 6
    header = next(line for line in output.splitlines() if line.startswith("layout"))
    assert header.split() == ["layout", "mode", "update", "term", "|Δgrad|", "rel", "|ΔJ|",
                              "rel", "result"]
    rows = [line.split() for line in output.splitlines() if line.startswith("dp")]
    assert {(r[0], r[1], r[3]) for r in rows} == {
        (layout, mode, term) for layout in PLANTS for mode in MODES
        for term in ("pg", "kl", "entropy")}
    failed = {(r[0], r[1], r[3]) for r in rows if r[-1] == "FAIL"}
    for planted in ("dp2cp1-packed", "dp2cp1-prefix"):
        assert {(m, t) for lay, m, t in failed if lay == planted} == {
            (mode, term) for mode in MODES for term in ("pg", "kl", "entropy")}, planted
    for r in rows:
        if r[0] == "dp2cp1-packed":  # ×2 on pg and KL: large; 1e-3 on entropy: small
            assert (float(r[5]) > 0.01) == (r[3] in ("pg", "kl")), r
    for mode in MODES:
        assert {("dp3cp1", mode, "kl"), ("dp3cp1", mode, "entropy")} <= failed
        assert {("dp1cp2", mode, "kl"), ("dp1cp2", mode, "entropy")} <= failed
    for r in rows:
        small = r[0] == "dp1cp2" or (r[0] == "dp2cp1-packed" and r[3] == "entropy")
        if small and r[-1] == "FAIL":  # one coefficient off by 1e-3
            assert 1e-7 < float(r[5]) < 1e-2, r
    assert f"{len(rows) - len(failed)}/{len(rows)} comparisons within tolerance" in output


def test_planted_errors_are_refused_where_they_would_plant_nothing() -> None:
    """Planted errors (a test's, not a user option) name their layout as --layouts does;
    an unknown error, or a layout that is not compared, is refused before anything
    starts: a planted nothing would pass."""
    layouts = parse_layouts("dp1cp1-padded,dp2cp1,dp1cp2")
    assert planted_by_layout({"DP2CP1": parse_planted("local_tokens, kl"),
                              "dp1cp2": parse_planted("entropy_coefficient")}, layouts) == {
        "dp2cp1": {PlantedError.LOCAL_TOKENS, PlantedError.KL},
        "dp1cp2": {PlantedError.ENTROPY_COEFFICIENT}}
    with pytest.raises(ValueError, match=r"unknown planted error.*local_token"):
        parse_planted("local_token")
    with pytest.raises(ValueError, match="dp2cp2 is not among --layouts"):
        planted_by_layout({"dp2cp2": parse_planted("kl")}, layouts)
    with pytest.raises(ValueError, match=r"dp2cp2.*not among the layouts"):  # no Ray
        verify_layouts(CONFIG, OBJECTIVE, "unused", random_train_batch(50, 2, 2, seed=0),
                       layouts, planted={"dp2cp2": parse_planted("kl")})


class BaseVerbsOnly(TrainerRank):
    """A rank with the base's verbs only (a backend's are never called here)."""

    def setup(self, master_addr: str, master_port: int) -> None: ...
    def optimizer_step(self) -> dict[str, float]: return {}
    def export_weights(self) -> None: ...
    def load_weights(self, state_dict: dict[str, torch.Tensor] | None) -> None: ...
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...


def test_a_rank_makes_its_share_of_the_planted_errors_and_none_by_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The errors are handed in (``TrainerRank.plant``), never read from the environment:
    a rank of the first DP×CP shard makes them all, any other the every-rank ones only,
    and a rank nobody planted in makes none, whatever its environment says."""
    planted = parse_planted("pg,local_tokens,prefix_mask,value")
    assert rank_planted(planted, first_shard=True) == planted
    assert rank_planted(planted, first_shard=False) == planted & PLANTED_ON_EVERY_RANK == {
        PlantedError.LOCAL_TOKENS, PlantedError.PREFIX_MASK}
    monkeypatch.setenv("TALLY_TEST_PLANTED_ERROR", "pg")  # the retired variable: ignored
    ranks = [BaseVerbsOnly(CONFIG, OBJECTIVE, "unused", rank, 1) for rank in range(2)]
    assert [rank.planted for rank in ranks] == [NOTHING_PLANTED, NOTHING_PLANTED]
    for rank, (dp_rank, cp_rank) in zip(ranks, [(0, 0), (0, 1)], strict=True):
        rank.dp_rank, rank.cp_rank = dp_rank, cp_rank
        rank.plant(planted)
    assert [rank.planted for rank in ranks] == [planted, planted & PLANTED_ON_EVERY_RANK]


def test_the_verifier_asks_the_estimator_whether_it_needs_reward_spread() -> None:
    """The verifier's rollout turns dynamic sampling on for an estimator that declares
    ``needs_reward_spread`` (a group baseline, a user's class too), and leaves the
    rollout alone for one that does not (reward, gae, distill): no type names."""
    from rollout.config import RolloutConfig
    from services.verify.aggregation import needs_reward_spread, spread_rollout

    toy = {"type": "custom", "class_path": "tests.rollout.toy_estimators:DrGRPO"}
    spread = {"grpo": True, "reinforce_pp": True, "reward": False, "gae": False}
    for name, advantage in [*((t, {"type": t}) for t in spread), ("custom", toy)]:
        rollout = RolloutConfig.model_validate({"advantage": advantage})
        wanted = spread.get(name, True)
        assert needs_reward_spread(rollout.advantage) is wanted, name
        drawn = spread_rollout(rollout).dynamic_sampling
        assert (drawn.enabled, drawn.max_draws) == ((True, 8) if wanted else (False, 4)), name


@pytest.mark.parametrize(("error", "terms"), [("shard_coefficient", ("pg", "kl", "entropy")),
                                              ("entropy_coefficient", ("entropy",))])
def test_a_planted_coefficient_error_moves_one_sample_of_the_shard(
        error: str, terms: tuple[str, ...]) -> None:
    """Padded and packed: the weights of the shard's sample with the most valid tokens,
    and only those, are ×(1 + 1e-3) in the planted terms."""
    from trainer.micro_batch import slice_for_plan
    from trainer.objective import PLANTED_COEFFICIENT_ERROR, _planted_weights
    from trainer.step_plan import plan_step

    batch = random_train_batch(vocab_size=50, num_prompts=3, group_size=2, seed=4)
    for packed in (False, True):
        plan = plan_step(batch, OBJECTIVE, 1, 2, 64, packed=packed)
        micro = slice_for_plan(batch, plan, plan.micro_batches[0][0], 2, 0)
        planted = _planted_weights(micro, frozenset({error}))
        sample = (micro.sequence_ids if packed else
                  torch.arange(micro.loss_mask.shape[0])[:, None].expand_as(micro.loss_mask))
        counts = torch.bincount(sample[micro.loss_mask > 0])
        assert len(counts) > 1
        chosen = sample == counts.argmax()
        for term, weights in micro.weights.items():
            factor = 1 + PLANTED_COEFFICIENT_ERROR if term in terms else 1.0
            assert torch.equal(planted[term][chosen], weights[chosen] * factor), term
            assert torch.equal(planted[term][~chosen], weights[~chosen]), term


@pytest.mark.parametrize(("dp", "cp", "packed"), [
    (dp, cp, packed) for dp in (1, 2, 3) for cp in (1, 2) for packed in (True, False)])
def test_whitening_statistics_reduced_over_every_rank_are_the_global_ones(
        dp: int, cp: int, packed: bool) -> None:
    """GAE's whitening reduces (n, Σ A, Σ A²) over the valid tokens every DP × CP rank
    holds (its micro-batches, shifted and cut to its CP shard): the sum is the whole
    rollout's, each token once, so μ and σ are the global ones; one rank's alone are not
    (what the planted ``local_whitening`` uses)."""
    from rollout.advantages import moments_mean_std, token_moments
    from trainer.step_plan import plan_step
    from trainer.verify import rank_token_moments

    batch = random_train_batch(vocab_size=40, num_prompts=6, group_size=2, seed=dp + cp,
                               per_token=True)
    plan = plan_step(batch, OBJECTIVE, dp, cp, max_tokens_per_micro_batch=20, packed=packed)
    per_rank = rank_token_moments(batch, plan, cp)
    assert per_rank.shape == (dp, cp, 3)
    whole = token_moments(batch.advantages, batch.loss_mask)
    assert per_rank.sum(dim=(0, 1)).tolist() == pytest.approx(whole.tolist(), rel=1e-12)
    assert moments_mean_std(per_rank.sum(dim=(0, 1))) == pytest.approx(
        moments_mean_std(whole), rel=1e-12)
    if dp * cp > 1:  # a rank's own statistics are not the rollout's
        own = [moments_mean_std(rank) for rank in per_rank.reshape(dp * cp, 3) if rank[0]]
        assert any(abs(mean - moments_mean_std(whole)[0]) > 1e-3 for mean, _ in own)


@pytest.mark.parametrize("packed", [True, False])
def test_the_verifier_whitens_a_layout_as_its_ranks_reduce(packed: bool) -> None:
    """The verifier's GAE whitening (production's ``whiten`` over the statistics every
    DP rank holds) against the formula written here: (A − μ) / (σ + ε) on the valid tokens
    with the whole rollout's μ and σ (Bessel); with ``local_whitening`` planted each DP
    rank's samples by their own μ and σ instead, which moves them."""
    from trainer.step_plan import plan_step
    from trainer.verify import rank_token_moments

    batch = random_train_batch(vocab_size=40, num_prompts=6, group_size=2, seed=1,
                               per_token=True)
    advantages, mask, eps = batch.advantages, batch.loss_mask, 0.1
    plan = plan_step(batch, OBJECTIVE, 2, 1, max_tokens_per_micro_batch=20, packed=packed)
    moments = rank_token_moments(batch, plan, 1)

    def reference(samples: list[int]) -> torch.Tensor:
        valid = mask[samples] > 0
        values = advantages[samples].double()
        mean, std = values[valid].mean(), values[valid].std()
        return torch.where(valid, (values - mean) / (std + eps), 0.0)

    clean = whitened_for_layout(advantages, mask, moments, plan.micro_batches, eps)
    assert torch.allclose(clean, reference(list(range(batch.num_samples))), rtol=1e-12,
                          atol=1e-12)
    local = whitened_for_layout(advantages, mask, moments, plan.micro_batches, eps,
                                frozenset({PlantedError.LOCAL_WHITENING}))
    for rank_micro_batches in plan.micro_batches:
        samples = [i for micro in rank_micro_batches for i in micro]
        assert torch.allclose(local[samples], reference(samples), rtol=1e-12, atol=1e-12)
    assert (local - clean).abs().max() > 1e-3


@pytest.mark.slow  # the demo's warm start, a critic and three layouts on Ray actors
def test_verify_aggregation_checks_the_critic_and_exits_1_on_its_planted_errors(
        ray_cluster: None, shared_data_dir: Path) -> None:
    """demo-ppo.yaml (critic, GAE, whitening): the policy's per-token advantages and the
    critic's ``value`` term under every mode, DP 2 against padded DP 1 (CP 2 and the
    shared prefix: tests/trainer/fsdp/test_critic.py, docs/ppo.md's run). Planted in DP 2:
    ``local_whitening`` (each rank whitens its samples by its own statistics) fails the pg
    rows, and only them of the policy's; ``value`` (the critic's rank 0 doubles its share)
    fails the value rows; KL and entropy stay within tolerance."""
    code, output = _verified(
        "demo-ppo.yaml", "dp1cp1-padded,dp2cp1-packed",
        ["rollout.global_batch_size=16", "rollout.rollout_batch_size=4",
         "rollout.n_samples_per_prompt=4"],
        {"dp2cp1-packed": parse_planted("local_whitening,value")})
    assert code == 1, output
    rows = [line.split() for line in output.splitlines() if line.startswith("dp")]
    assert {(r[0], r[1], r[3]) for r in rows} == {
        ("dp2cp1-packed", mode, term) for mode in MODES
        for term in ("pg", "kl", "entropy", "value")}
    failed = {(r[1], r[3]) for r in rows if r[-1] == "FAIL"}
    assert failed == {(mode, term) for mode in MODES for term in ("pg", "value")}


@pytest.mark.slow  # the demo's warm start and four layouts on Ray actors
def test_gspo_with_a_sequence_correction_is_exact_under_every_layout(
        ray_cluster: None, shared_data_dir: Path) -> None:
    """GSPO's sequence ratio and a sequence-level rollout correction need a sample's whole
    response, which packing and CP split (trainer/objective.py: sample_sums): the
    verify-aggregation program passes over padded, packed, shared-prefix and CP 2 layouts.
    Two PPO epochs, so the second update's policy has moved off π_old (s_i ≠ 1) and the
    correction's π_old/π_rollout is the perturbed policy's."""
    layouts = "dp1cp1-padded,dp2cp1-packed,dp2cp1-prefix,dp1cp2"
    code, output = _verified("demo.yaml", layouts, [
        "rollout.global_batch_size=16", "trainer.ppo_epochs=2",
        "trainer.loss.policy_loss=gspo", "trainer.loss.rollout_correction.level=sequence"],
        {})
    assert code == 0, output
    rows = [line.split() for line in output.splitlines() if line.startswith("dp")]
    assert {(r[0], r[2]) for r in rows} == {(lay, update) for lay in layouts.split(",")[1:]
                                           for update in ("0", "1")}
    assert all(r[-1] == "ok" for r in rows) and len(rows) == 3 * 2 * len(MODES) * 3
