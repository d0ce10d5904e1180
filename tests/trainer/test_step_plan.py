from __future__ import annotations

import pytest
import torch

from tests.trainer.helpers import random_train_batch
from tests.trainer.reducers import discounted_group_mean
from trainer.aggregation import token_weights
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.context_parallel import zigzag_unshard
from trainer.micro_batch import slice_for_plan, slice_micro_batch, slice_packed_row
from trainer.step_plan import assign_micro_batches, padding_fraction, plan_step

LENGTHS = [9, 3, 14, 5, 5, 7, 2, 11, 6, 4]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("budget", [8, 20, 64])
def test_every_sample_once_within_budget_and_equal_counts(dp_size: int, budget: int,
                                                          packed: bool) -> None:
    plans = assign_micro_batches(LENGTHS, dp_size, budget, packed)
    assert len(plans) == dp_size
    assert len({len(p) for p in plans}) == 1  # FSDP needs the same number of forwards
    seen = sorted(i for plan in plans for micro in plan for i in micro)
    assert seen == list(range(len(LENGTHS)))
    for plan in plans:
        for micro in plan:
            if len(micro) > 1:  # a lone over-long sample is allowed its own micro-batch
                cost = (sum(LENGTHS[i] for i in micro) if packed
                        else len(micro) * max(LENGTHS[i] for i in micro))
                assert cost <= budget


def test_first_fit_decreasing_fills_rows_and_gives_a_long_sample_its_own() -> None:
    [rows] = assign_micro_batches([6, 30, 4, 5, 3, 2], 1, 10, packed=True)
    assert rows == [[1], [0, 2], [3, 4, 5]]  # 30 > budget alone; 6+4; 5+3+2
    # Balanced by tokens (longest first onto the least loaded rank): 14+5+3, 11+6+4+2,
    # 9+7+5; then rows of ≤ 12: 14 alone and 5+3; 11 alone and 6+4+2; 9 alone and 7+5.
    assert assign_micro_batches(LENGTHS, 3, 12, packed=True) == [
        [[2], [3, 1]], [[7], [8, 9, 6]], [[0], [5, 4]]]


def test_a_rank_with_fewer_rows_gets_empty_ones() -> None:
    """12 | 4 4 4 by tokens; the three 4s need two rows of 8, so rank 0 runs an empty
    second row (FSDP's collectives need as many forwards on every rank)."""
    assert assign_micro_batches([12, 4, 4, 4], 2, 8, packed=True) == [[[0], []],
                                                                      [[1, 2], [3]]]
    assert assign_micro_batches([12, 4, 4, 4], 2, 8, packed=False) == [[[0], []],
                                                                       [[1, 2], [3]]]


def test_packed_plan_records_cu_seqlens_and_has_no_padding_without_cp() -> None:
    batch = random_train_batch(vocab_size=50, num_prompts=4, group_size=3)
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)
    lengths = batch.sequence_lengths.tolist()
    for cp_size in (1, 2):
        plan = plan_step(batch, objective, dp_size=2, cp_size=cp_size,
                         max_tokens_per_micro_batch=24)
        assert plan.packed
        for rank, bounds in zip(plan.micro_batches, plan.cu_seqlens, strict=True):
            for samples, cu in zip(rank, bounds, strict=True):
                rounded = [-(-lengths[i] // (2 * cp_size)) * 2 * cp_size if cp_size > 1
                           else lengths[i] for i in samples]
                assert cu == [0, *torch.tensor(rounded, dtype=torch.long).cumsum(0).tolist()]
        if cp_size == 1:
            assert plan.padding_fraction == 0.0
        padded = plan_step(batch, objective, dp_size=2, cp_size=cp_size,
                           max_tokens_per_micro_batch=24, packed=False)
        assert padded.padding_fraction > plan.padding_fraction


def test_ranks_are_balanced_by_tokens() -> None:
    plans = assign_micro_batches(LENGTHS, 2, 1000, packed=False)
    loads = [sum(LENGTHS[i] for micro in plan for i in micro) for plan in plans]
    assert abs(loads[0] - loads[1]) <= max(LENGTHS)


def test_padding_fraction_counts_cp_padding() -> None:
    plans = [[[0, 1]]]  # lengths 9 and 3 padded to 9: 6 of 18 are padding
    assert padding_fraction(LENGTHS, plans, cp_size=1, packed=False) == pytest.approx(6 / 18)
    # CP=2 pads to a multiple of 4: width 12, 24 slots, 12 real.
    assert padding_fraction(LENGTHS, plans, cp_size=2, packed=False) == pytest.approx(12 / 24)
    # packed: each sample is rounded to 4 on its own: 12 + 4 slots, 12 real
    assert padding_fraction(LENGTHS, plans, cp_size=1) == 0.0
    assert padding_fraction(LENGTHS, plans, cp_size=2) == pytest.approx(4 / 16)


def test_plan_ships_per_sample_coefficients_for_terms_and_every_mode() -> None:
    batch = random_train_batch(vocab_size=50)
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)
    plan = plan_step(batch, objective, dp_size=2, cp_size=1, max_tokens_per_micro_batch=32)
    assert plan.terms == ["pg", "kl", "entropy", "value", "pg_loss/sample_mean",
                          "pg_loss/token_mean", "pg_loss/prompt_mean", "pg_loss/constant"]
    assert plan.dense_weights == {}
    for coefficients in plan.coefficients.values():
        assert coefficients.shape == (batch.num_samples,)
        assert coefficients.dtype == torch.float64
    # sample_mean: c_i = 1/(N·M_i), so one non-empty sample's weights sum to 1/N.
    counts = batch.sample_token_counts.double()
    nonempty = counts > 0
    sample_sums = plan.coefficients["pg"] * counts
    assert sample_sums[nonempty].tolist() == pytest.approx([1 / batch.num_samples] * int(
        nonempty.sum()))
    assert plan.coefficients["pg_loss/constant"].tolist() == pytest.approx(
        [1 / (8 * batch.num_samples)] * batch.num_samples)


def test_micro_batches_rebuild_the_dense_weights_exactly() -> None:
    batch = random_train_batch(vocab_size=50)
    objective = ObjectiveConfig.compose(AggregationConfig(mode="prompt_mean"), LossConfig(),
                                        8, 1.0)
    plan = plan_step(batch, objective, dp_size=2, cp_size=1, max_tokens_per_micro_batch=20,
                     packed=False)
    dense = token_weights(batch.loss_mask, batch.group_index, "prompt_mean")
    total = 0.0
    for rank_plan in plan.micro_batches:
        for samples in rank_plan:
            micro = slice_micro_batch(batch, plan, samples, cp_size=1, cp_rank=0)
            total += float(micro.weights["pg"].sum())
            if samples:  # shifted by one position: weight of token t sits at t−1
                width = micro.weights["pg"].shape[1]
                expected = dense[samples, 1:width]
                assert torch.equal(micro.weights["pg"][:, :-1], expected)
    assert total == pytest.approx(float(dense.sum()))


def test_plan_size_is_per_sample_not_per_token() -> None:
    """The plan that travels to every rank is O(N) per term, not O(N·S)."""
    batch = random_train_batch(vocab_size=50, num_prompts=8, group_size=4)
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)
    plan = plan_step(batch, objective, dp_size=2, cp_size=1, max_tokens_per_micro_batch=64)
    shipped = sum(c.numel() for c in plan.coefficients.values())
    assert shipped == len(plan.coefficients) * batch.num_samples


@pytest.mark.parametrize("cp_size", [1, 2])
def test_packed_rows_carry_each_samples_shifted_tensors_without_crossing_a_boundary(
        cp_size: int) -> None:
    """Every per-token tensor of a packed row, unsharded over CP ranks and cut at the
    row's cu_seqlens, is exactly that sample's padded micro-batch row: targets, mask and
    weights shifted within the sample, positions restarting at 0; the weights of all
    rows sum to the dense aggregation weights."""
    batch = random_train_batch(vocab_size=50, num_prompts=4, group_size=3, seed=1)
    objective = ObjectiveConfig.compose(AggregationConfig(mode="token_mean"), LossConfig(),
                                        8, 1.0)
    plan = plan_step(batch, objective, dp_size=2, cp_size=cp_size, max_tokens_per_micro_batch=30)
    dense = token_weights(batch.loss_mask, batch.group_index, "token_mean")
    total = 0.0
    for rank_rows, rank_bounds in zip(plan.micro_batches, plan.cu_seqlens, strict=True):
        for samples, bounds in zip(rank_rows, rank_bounds, strict=True):
            shards = [slice_packed_row(batch, plan, samples, cp_size, r) for r in range(cp_size)]
            total += sum(float(s.weights["pg"].sum()) for s in shards)
            if not samples:
                assert all(float(s.weights["pg"].abs().sum()) == 0 for s in shards)
                continue
            offset = 0
            for slot, i in enumerate(samples):
                n = int(batch.sequence_lengths[i])
                local = (bounds[slot + 1] - bounds[slot]) // cp_size

                def full(name: str, term: str | None = None,
                         shards=shards, offset=offset, local=local, n=n) -> torch.Tensor:
                    parts = [(s.weights[term] if term else getattr(s, name))[0, offset:
                             offset + local] for s in shards]
                    return zigzag_unshard(parts, n)

                alone = slice_micro_batch(batch, plan, [i], cp_size=1, cp_rank=0)
                for name in ("input_ids", "targets", "loss_mask", "rollout_log_probs"):
                    assert torch.equal(full(name), getattr(alone, name)[0, :n]), name
                assert torch.equal(full("position_ids"), torch.arange(n))
                assert torch.equal(full("sequence_ids"), torch.full((n,), slot))
                assert torch.equal(full("", "pg"), alone.weights["pg"][0, :n])
                assert float(alone.weights["pg"][0, n - 1]) == 0.0  # last token: no target
                offset += local
    assert total == pytest.approx(float(dense.sum()), rel=1e-12)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_custom_reducer_weights_reach_every_shard_exactly(packed: bool, cp_size: int) -> None:
    """The dense path: a custom reducer's [N, S] weights travel in the plan (not as
    per-sample coefficients) and every token of every DP rank's micro-batch and CP shard
    carries the weight of its target, w[i, p + 1] at true position p (0 on padding), so
    the shards together hold each weight once."""
    batch = random_train_batch(vocab_size=50, num_prompts=4, group_size=3, seed=2)
    objective = ObjectiveConfig.compose(
        AggregationConfig(custom_reducer="tests.trainer.reducers:discounted_group_mean"),
        LossConfig(), 8, 1.0)
    plan = plan_step(batch, objective, dp_size=2, cp_size=cp_size,
                     max_tokens_per_micro_batch=16, packed=packed)
    dense = discounted_group_mean(batch.loss_mask, batch.group_index)
    # the value term is planned under the pg field too (a critic's objective names its
    # own reducer there: critic.custom_reducer)
    assert set(plan.dense_weights) == {"pg", "value"}
    assert not {"pg", "value"} & set(plan.coefficients)
    assert torch.equal(plan.dense_weights["pg"], dense)
    assert "pg" in plan.terms
    target_weight = torch.nn.functional.pad(dense[:, 1:], (0, 4 * cp_size))
    total, num_micro_batches = 0.0, 0
    for rank_samples in plan.micro_batches:
        for samples in rank_samples:
            num_micro_batches += bool(samples)
            for cp_rank in range(cp_size):
                micro = slice_for_plan(batch, plan, samples, cp_size, cp_rank)
                got = micro.weights["pg"]
                if not samples:
                    assert float(got.abs().sum()) == 0.0
                    continue
                slot = (micro.sequence_ids if packed else
                        torch.arange(len(samples))[:, None].expand_as(micro.position_ids))
                sample = torch.tensor(samples)[slot]
                assert torch.equal(got, target_weight[sample, micro.position_ids])
                total += float(got.sum())
    assert num_micro_batches > 2  # several per rank
    assert total == pytest.approx(float(dense.sum()), rel=1e-12)


def test_shared_prefix_keeps_groups_whole_and_splits_one_over_the_budget() -> None:
    """Each group whose prompt is identical is one item on one DP rank, its head first and
    its other samples skipping P − 1 tokens; a group longer than the budget is cut into
    chunks that each carry the prompt again (a head of their own)."""
    batch = random_train_batch(200, num_prompts=4, group_size=4, seed=5)
    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)
    budget = 20
    plan = plan_step(batch, objective, dp_size=2, cp_size=1, max_tokens_per_micro_batch=budget,
                     shared_prefix=True)
    skip, head = plan.prefix_skip, plan.prefix_head
    assert skip is not None and head is not None
    for rank_rows in plan.micro_batches:
        for row in rank_rows:
            cost = int((batch.sequence_lengths[row] - skip[row]).sum())
            assert cost <= budget or len(row) == 1
            for k, i in enumerate(row):
                if skip[i]:  # reads its head, which sits earlier in the same row
                    assert int(head[i]) in row[:k]
                    assert batch.group_index[head[i]] == batch.group_index[i]
                    assert int(skip[i]) == int(batch.prompt_lengths[i]) - 1
                else:
                    assert int(head[i]) == i
    rank_of = {i: r for r, rows in enumerate(plan.micro_batches) for row in rows for i in row}
    assert sorted(rank_of) == list(range(batch.num_samples))
    for i in range(batch.num_samples):  # a chunk never straddles two ranks
        assert rank_of[int(head[i])] == rank_of[i]
    heads_per_group = {int(g): len({int(head[i]) for i in range(batch.num_samples)
                                    if batch.group_index[i] == g})
                       for g in batch.group_ids}
    assert max(heads_per_group.values()) > 1  # some group was over the budget: chunks
    assert plan.computed_tokens == int((batch.sequence_lengths - skip).sum())
    unshared = plan_step(batch, objective, 2, 1, budget)
    assert unshared.prefix_skip is None
    assert plan.computed_tokens < unshared.computed_tokens == int(batch.sequence_lengths.sum())


def _prefix_items_by_group_scan(batch, max_tokens):
    """The plain reading of ``prefix_items``' docstring, one tensor scan per group: the
    reference the one-pass version must equal."""
    lengths = batch.sequence_lengths.tolist()
    skip = torch.zeros(batch.num_samples, dtype=torch.int64)
    items, costs = [], []
    for group in batch.group_ids.tolist():
        members = (batch.group_index == group).nonzero().flatten().tolist()
        prompt = int(batch.prompt_lengths[members[0]])
        same = all(int(batch.prompt_lengths[j]) == prompt for j in members) and bool(
            (batch.input_ids[members, :prompt] == batch.input_ids[members[0], :prompt]).all())
        if not same or prompt < 2 or len(members) == 1:
            items += [[j] for j in members]
            costs += [lengths[j] for j in members]
            continue
        shared, first = prompt - 1, True
        for j in sorted(members, key=lambda j: (-lengths[j], j)):
            if not first and costs[-1] + lengths[j] - shared <= max_tokens:
                items[-1].append(j)
                costs[-1] += lengths[j] - shared
                skip[j] = shared
            else:
                items.append([j])
                costs.append(lengths[j])
            first = False
    return items, costs, skip


@pytest.mark.parametrize("seed", range(6))
def test_prefix_items_equal_a_scan_per_group_with_odd_groups(seed: int) -> None:
    """Groups whose prompts differ in a token or a length, prompts of one token, groups of
    one sample, shuffled group order and budgets that cut groups into chunks."""
    from rollout.batch import RolloutBatch
    from trainer.step_plan import prefix_items

    gen = torch.Generator().manual_seed(seed)
    group_size = [1, 2, 4, 8, 3, 5][seed]
    prompts, responses, group_index = [], [], []
    for g in torch.randperm(7, generator=gen).tolist():
        prompt = torch.randint(3, 50, (int(torch.randint(1, 9, (1,), generator=gen)),),
                               generator=gen).tolist()
        for _ in range(group_size):
            odd = float(torch.rand((), generator=gen))
            own = ([*prompt[:-1], 99] if odd < 0.1 else [*prompt, 7] if odd < 0.2
                   else prompt)
            prompts.append(own)
            responses.append([5] * int(torch.randint(1, 16, (1,), generator=gen)))
            group_index.append(3 * g + 1)
    batch = RolloutBatch.from_samples(prompts, responses, [[-1.0] * len(r) for r in responses],
                                      [0.0] * len(prompts), [0.0] * len(prompts), group_index,
                                      group_size)
    for budget in (6, 12, 30, 2048):
        items, costs, skip = prefix_items(batch, budget)
        want_items, want_costs, want_skip = _prefix_items_by_group_scan(batch, budget)
        assert items == want_items and costs == want_costs and torch.equal(skip, want_skip)


@pytest.mark.parametrize(("packed", "cp_size"), [(True, 1), (True, 2), (False, 2)])
def test_the_value_term_has_weights_of_its_own_equal_to_the_main_terms(
        packed: bool, cp_size: int) -> None:
    """The critic's value loss reads ``micro.weights["value"]`` (trainer/terms.py VALUE),
    planned under the objective's main aggregation: bit for bit the numbers it read under
    ``pg`` before, in every shard; zeroing pg's weights leaves the value loss alone,
    zeroing its own moves it."""
    import dataclasses

    from trainer.value_loss import micro_batch_value_objective

    batch = random_train_batch(vocab_size=50, num_prompts=4, group_size=3, seed=3)
    objective = ObjectiveConfig.compose(AggregationConfig(mode="prompt_mean"),
                                        LossConfig(), 8, 1.0)
    plan = plan_step(batch, objective, dp_size=2, cp_size=cp_size,
                     max_tokens_per_micro_batch=16, packed=packed)
    assert torch.equal(plan.coefficients["value"], plan.coefficients["pg"])
    generator = torch.Generator().manual_seed(0)
    for rank_samples in plan.micro_batches:
        for samples in rank_samples:
            for cp_rank in range(cp_size):
                micro = slice_for_plan(batch, plan, samples, cp_size, cp_rank)
                assert torch.equal(micro.weights["value"], micro.weights["pg"])
                shape = micro.loss_mask.shape
                micro = dataclasses.replace(
                    micro, returns=torch.randn(shape, generator=generator),
                    old_values=torch.randn(shape, generator=generator))
                values = torch.randn(shape, generator=generator, dtype=torch.float64)
                _, sums = micro_batch_value_objective(values, micro, 0.2)
                no_pg = dataclasses.replace(micro, weights={
                    **micro.weights, "pg": torch.zeros_like(micro.weights["pg"])})
                assert torch.equal(micro_batch_value_objective(values, no_pg, 0.2)[1], sums)
                if float(micro.weights["value"].abs().sum()) > 0:
                    no_value = dataclasses.replace(micro, weights={
                        **micro.weights, "value": torch.zeros_like(micro.weights["value"])})
                    assert micro_batch_value_objective(values, no_value, 0.2)[1][0] == 0
                    assert sums[0] != 0
