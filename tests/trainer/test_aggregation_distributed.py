"""Real gloo process groups: any DP × CP × micro-batch layout, padded or packed into rows,
gives the reference J and ∇J.

Each rank owns some samples (DP, groups deliberately split across ranks), cuts them into
micro-batches, keeps its zigzag CP shard of every sequence, backpropagates its local
Σ w·ℓ, and the gradients are SUMMED over all ranks. The result must equal the
single-process float64 reference within 1e-10 relative.

The ranks are spawned once (process start-up is most of the cost): every layout runs on
its own subgroup (``dist.new_group``) of the first dp·cp ranks, one layout after another.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from trainer.aggregation import AGGREGATION_MODES, aggregate, local_weighted_sum, token_weights
from trainer.context_parallel import padded_length, zigzag_shard
from trainer.step_plan import assign_micro_batches

NUM_SAMPLES, GROUP_SIZE, MAX_LEN, FEATURES = 12, 3, 9, 5
DIVISOR = 16.0
MICRO_BATCH_COUNTS = (1, 2, 3)
LAYOUTS = [(dp_size, cp_size) for dp_size in (1, 2, 3) for cp_size in (1, 2)]
"""(dp, cp) of every layout checked; the largest sets how many ranks are spawned."""


def make_step(seed: int = 0) -> dict[str, torch.Tensor]:
    """Uneven lengths, two zero-token samples, groups interleaved across the batch."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_LEN + 1, (NUM_SAMPLES,), generator=gen)
    lengths[[2, 7]] = 0
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).to(torch.float64)
    groups = torch.arange(NUM_SAMPLES // GROUP_SIZE).repeat_interleave(GROUP_SIZE) + 100
    order = torch.randperm(NUM_SAMPLES, generator=gen)
    return {
        "features": torch.randn(NUM_SAMPLES, MAX_LEN, FEATURES, generator=gen, dtype=torch.float64),
        "mask": mask[order],
        "groups": groups[order],
        "weights_init": torch.randn(FEATURES, generator=gen, dtype=torch.float64),
    }


def per_token_loss(features: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """A non-linear per-token loss of a parameter vector: [..., T, F] -> [..., T]."""
    logits = features @ params
    return torch.nn.functional.softplus(logits) + 0.5 * torch.sin(3 * logits)


def reference(step: dict[str, torch.Tensor], mode: str) -> tuple[float, torch.Tensor]:
    params = step["weights_init"].clone().requires_grad_(True)
    loss = aggregate(per_token_loss(step["features"], params), step["mask"], step["groups"],
                     mode, DIVISOR if mode == "constant" else None)
    loss.backward()
    return float(loss.detach()), params.grad.clone()


def layout_worker(rank: int, world_size: int, cp_size: int, group: dist.ProcessGroup) -> dict:
    """This rank's J and ∇J, summed over ``group`` (the layout's world_size ranks)."""
    step = make_step()
    dp_size, dp_rank, cp_rank = world_size // cp_size, rank // cp_size, rank % cp_size
    # Uneven DP split of a permutation: groups straddle DP ranks.
    owned = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(1))
    owned = owned.tensor_split(dp_size)[dp_rank]
    results = {}
    for mode in AGGREGATION_MODES:
        divisor = DIVISOR if mode == "constant" else None
        weights = token_weights(step["mask"], step["groups"], mode, divisor)  # whole step, once
        for num_micro_batches in MICRO_BATCH_COUNTS:
            params = step["weights_init"].clone().requires_grad_(True)
            local_objective = torch.zeros((), dtype=torch.float64)
            for micro in owned.tensor_split(num_micro_batches):
                features = zigzag_shard(step["features"][micro], cp_size, cp_rank, dim=1)
                micro_weights = zigzag_shard(weights[micro], cp_size, cp_rank, dim=1)
                local = local_weighted_sum(per_token_loss(features, params), micro_weights)
                local.backward()  # micro-batches accumulate by plain addition
                local_objective += local.detach()
            grad = params.grad if params.grad is not None else torch.zeros_like(params)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(local_objective, op=dist.ReduceOp.SUM, group=group)
            results[(mode, num_micro_batches)] = (float(local_objective), grad.clone())
        results[(mode, "packed")] = packed_rows_objective(step, weights, dp_size, dp_rank,
                                                          cp_size, cp_rank, group)
    return results


def every_layout_worker(rank: int, world_size: int) -> dict[tuple[int, int], dict]:
    """Each layout on the subgroup of ranks 0..dp·cp−1; {(dp, cp): this rank's results}
    for the layouts this rank is part of."""
    results = {}
    for dp_size, cp_size in LAYOUTS:
        members = list(range(dp_size * cp_size))
        group = dist.new_group(members)  # collective: every rank of the world calls it
        if rank in members:
            results[dp_size, cp_size] = layout_worker(rank, len(members), cp_size, group)
    return results


PACK_BUDGET = 8
"""Tokens per packed row: several rows per rank, and the longest samples (9) exceed it."""


def packed_rows_objective(step: dict[str, torch.Tensor], weights: torch.Tensor, dp_size: int,
                          dp_rank: int, cp_size: int, cp_rank: int, group: dist.ProcessGroup
                          ) -> tuple[float, torch.Tensor]:
    """The trainer's packed layout: the step plan's rows (first-fit decreasing, equal row
    counts per rank, empty rows added), each sample of a row rounded up to 2·cp and
    zigzag-sharded on its own, the samples of a row back to back in one sequence."""
    lengths = [int(n) for n in step["mask"].sum(dim=-1)]
    budget_lengths = [padded_length(n, cp_size) for n in lengths]
    rows = assign_micro_batches(budget_lengths, dp_size, PACK_BUDGET, packed=True)[dp_rank]
    params = step["weights_init"].clone().requires_grad_(True)
    objective = torch.zeros((), dtype=torch.float64)
    for row in rows:
        features = torch.cat([zigzag_shard(step["features"][i, :lengths[i]], cp_size, cp_rank,
                                           dim=0) for i in row] or [torch.zeros(0, FEATURES,
                                                                    dtype=torch.float64)])
        row_weights = torch.cat([zigzag_shard(weights[i, :lengths[i]], cp_size, cp_rank)
                                 for i in row] or [torch.zeros(0, dtype=torch.float64)])
        local = local_weighted_sum(per_token_loss(features[None], params), row_weights[None])
        local.backward()
        objective += local.detach()
    grad = params.grad if params.grad is not None else torch.zeros_like(params)
    dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(objective, op=dist.ReduceOp.SUM, group=group)
    return float(objective), grad.clone()


@pytest.fixture(scope="module")
def per_rank_results() -> list[dict[tuple[int, int], dict]]:
    """Every layout's results from one spawn of the largest layout's ranks."""
    return run_distributed(every_layout_worker, max(dp * cp for dp, cp in LAYOUTS))


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_every_layout_reproduces_the_reference(
        per_rank_results: list[dict[tuple[int, int], dict]], dp_size: int, cp_size: int) -> None:
    step = make_step()
    expected = {mode: reference(step, mode) for mode in AGGREGATION_MODES}
    layout_ranks = [results[dp_size, cp_size] for results in per_rank_results
                    if (dp_size, cp_size) in results]
    assert len(layout_ranks) == dp_size * cp_size
    for results in layout_ranks:
        assert set(results) == {(mode, k) for mode in AGGREGATION_MODES
                                for k in (*MICRO_BATCH_COUNTS, "packed")}
        for (mode, num_micro_batches), (objective, grad) in results.items():
            ref_objective, ref_grad = expected[mode]
            where = f"{mode} dp={dp_size} cp={cp_size} micro={num_micro_batches}"
            assert objective == pytest.approx(ref_objective, rel=1e-10), where
            torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14, msg=where)
