"""Sequence quantities under CP and packing, on real gloo process groups: a sample's tokens
are spread over the CP ranks' zigzag shards and share packed rows with other samples, yet
``sample_sums`` (trainer/objective.py) gives every token its sample's total over the
whole response, and GSPO and the sequence-level corrections through the objective give
the single-process float64 J and ∇J. Skipping the CP reduction (the planted error: each
rank sums only its own shard) is caught by the same comparison."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rollout.batch import RolloutBatch
from tests.distributed import run_distributed
from tests.trainer.helpers import random_train_batch
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.micro_batch import slice_for_plan
from trainer.objective import LOGGED_SUMS, TokenLogProbs, micro_batch_objective, sample_sums
from trainer.step_plan import plan_step

CP = 2
BUDGET = 24
"""Tokens per packed row: several rows, several samples in a row."""
LOSSES = {
    "gspo": LossConfig(policy_loss="gspo", eps_clip=0.003,
                       rollout_correction={"level": "sequence", "high": 1.02}),
    "ppo+geometric-mask": LossConfig(rollout_correction={"level": "geometric", "mode": "mask",
                                                         "low": 0.995, "high": 1.004}),
}
"""Clip bounds that cut some samples and spare others on this batch (checked below)."""
CLIPPED, DROPPED = LOGGED_SUMS.index("clipped_tokens"), LOGGED_SUMS.index("correction_dropped")


def make_batch() -> RolloutBatch:
    """Whole groups, uneven lengths (longer than a CP chunk), fractional weights, an
    empty sample; the old policy off the engine's by a per-token amount."""
    batch = random_train_batch(vocab_size=50, num_prompts=4, group_size=2, seed=3,
                               per_token=True)
    gen = torch.Generator().manual_seed(3)
    return batch.with_old_log_probs(batch.rollout_log_probs
                                    + 0.01 * torch.randn(batch.loss_mask.shape, generator=gen))


def reference_sums(batch: RolloutBatch) -> torch.Tensor:
    """Each sample's Σ of its rollout log-prob over its valid tokens, from the batch."""
    valid = batch.loss_mask > 0
    return torch.where(valid, batch.rollout_log_probs.double(), 0.0).sum(-1)


def run_layout(batch: RolloutBatch, cp_size: int, cp_rank: int, packed: bool,
               group: dist.ProcessGroup | None, reduce: bool = True) -> dict:
    """{sample: the totals its valid tokens hold}, and per loss (J, ∂J/∂θ, clipped, dropped)
    summed over the group, where log π_θ = log π_old + θ·sin(target id) (the same function
    of a token in every layout) at θ = 0.05. ``reduce`` False: the planted error."""
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 16, 1.0)
    plan = plan_step(batch, objective, 1, cp_size, BUDGET, packed=packed)
    cp_group = group if reduce else None
    totals: dict[int, set[float]] = {}
    results = {}
    for samples in plan.micro_batches[0]:
        micro = slice_for_plan(batch, plan, samples, cp_size, cp_rank)
        valid = micro.loss_mask > 0
        held = sample_sums(torch.where(valid, micro.rollout_log_probs.double(), 0.0), micro,
                           cp_group)
        owner = micro.sequence_ids if micro.sequence_ids is not None else torch.arange(
            held.shape[0])[:, None].expand_as(held)
        for slot, value in zip(owner[valid].tolist(), held[valid].tolist(), strict=True):
            totals.setdefault(samples[slot], set()).add(round(value, 9))
    for name, loss in LOSSES.items():
        objective = ObjectiveConfig.compose(AggregationConfig(), loss, 16, 1.0)
        plan = plan_step(batch, objective, 1, cp_size, BUDGET, packed=packed)
        theta = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
        value = torch.zeros((), dtype=torch.float64)
        logged = None
        for samples in plan.micro_batches[0]:
            micro = slice_for_plan(batch, plan, samples, cp_size, cp_rank)
            log_probs = micro.old_log_probs.double() + theta * torch.sin(micro.targets.double())
            token = TokenLogProbs(log_probs, torch.zeros_like(log_probs))
            j, sums = micro_batch_objective(token, micro, loss, plan.mode_metric_names,
                                            cp_group=cp_group)
            j.backward()
            value = value + j.detach()
            logged = sums if logged is None else logged + sums
        out = torch.stack([value, theta.grad.detach(), logged[CLIPPED], logged[DROPPED]])
        if group is not None:
            dist.all_reduce(out, group=group)
        results[name] = out
    return {"totals": totals, "objective": results}


def cp_worker(rank: int, world_size: int) -> dict:
    batch = make_batch()
    return {(packed, reduce): run_layout(batch, world_size, rank, packed, dist.group.WORLD,
                                         reduce)
            for packed in (False, True) for reduce in (True, False)}


@pytest.fixture(scope="module")
def layouts() -> dict:
    """{layout: results}: the single-process reference, padded and packed (one process),
    and CP 2 padded and packed, with and without the reduction (one spawn)."""
    batch = make_batch()
    out = {("cp1", packed): run_layout(batch, 1, 0, packed, None) for packed in (False, True)}
    ranks = run_distributed(cp_worker, CP)
    for key in ranks[0]:
        merged: dict[int, set[float]] = {}
        for rank in ranks:
            for sample, values in rank[key]["totals"].items():
                merged.setdefault(sample, set()).update(values)
        out["cp2", *key] = {"totals": merged, "objective": ranks[0][key]["objective"]}
    return out


@pytest.mark.slow  # two spawned gloo ranks
def test_every_token_holds_its_samples_whole_total(layouts: dict) -> None:
    expected = reference_sums(make_batch())
    for name in [("cp1", False), ("cp1", True), ("cp2", False, True), ("cp2", True, True)]:
        totals = layouts[name]["totals"]
        assert set(totals) == {i for i in range(len(expected)) if expected[i] != 0}, name
        for sample, values in totals.items():
            assert values == {round(float(expected[sample]), 9)}, (name, sample, values)
    for packed in (False, True):  # the planted error: each CP rank its own shard's sum
        totals = layouts["cp2", packed, False]["totals"]
        assert any(len(v) > 1 or v != {round(float(expected[s]), 9)}
                   for s, v in totals.items()), packed


@pytest.mark.slow  # two spawned gloo ranks
def test_sequence_losses_are_exact_under_cp_and_packing_and_a_missing_reduction_fails(
        layouts: dict) -> None:
    """J, ∂J/∂θ, clipped tokens and correction-dropped tokens of GSPO with a sequence
    truncation and of PPO with a geometric mask: every layout equals the padded single
    process within float64 rounding (1e-12 relative); without the CP reduction they move
    far beyond it."""
    reference = layouts["cp1", False]["objective"]
    for name, ref in reference.items():
        assert ref[1] != 0 and ref[2] + ref[3] > 0, (name, ref)  # a gradient; something cut
        for layout in [("cp1", True), ("cp2", False, True), ("cp2", True, True)]:
            got = layouts[layout]["objective"][name]
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-15,
                                       msg=f"{name} {layout}")
        for packed in (False, True):
            planted = layouts["cp2", packed, False]["objective"][name]
            assert not torch.allclose(planted, ref, rtol=1e-6, atol=0), (name, packed)
