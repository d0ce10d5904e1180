"""The row layout: built where a packed row is cut, checked where it is used (each
broken invariant is a ValueError naming the slot), and the one mask every kernel
computes (the SDPA pieces equal the layout's dense mask, windows included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.helpers import random_train_batch
from trainer.attention_pieces import pieces_attention, plan_pieces
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.micro_batch import slice_packed_row
from trainer.row_layout import RowLayout, packed_row_index, visible
from trainer.step_plan import plan_step

OBJECTIVE = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)


def shared_row() -> RowLayout:
    """Slot 0 a head of 7 tokens, slots 1-2 its followers (from position 4), slot 3 alone."""
    return RowLayout.build(torch.tensor([7, 6, 9, 5]), starts_N=torch.tensor([0, 4, 4, 0]),
                           heads_N=torch.tensor([0, 0, 0, 3]))


def test_the_plans_rows_carry_their_layout() -> None:
    batch = random_train_batch(vocab_size=50, num_prompts=3, group_size=3, seed=4)
    plan = plan_step(batch, OBJECTIVE, 1, 1, 64, shared_prefix=True)
    assert plan.prefix_skip is not None
    for samples in plan.micro_batches[0]:
        micro = slice_packed_row(batch, plan, samples, 1, 0)
        layout = micro.layout
        layout.check(micro.position_ids)
        assert torch.equal(layout.slot_T[None], micro.sequence_ids)
        for k, i in enumerate(samples):
            head = samples[int(layout.heads_N[k])]
            assert int(plan.prefix_head[i]) == head
            assert int(layout.starts_N[k]) == int(plan.prefix_skip[i])


def test_a_cp_rows_keys_are_every_ranks_tokens_in_rank_order() -> None:
    lengths = torch.tensor([5, 9, 3])
    layout = RowLayout.build(lengths, cp_size=2, cp_rank=1)
    slots, positions = zip(*(packed_row_index(lengths, 2, r) for r in range(2)), strict=True)
    assert torch.equal(layout.keys[0], torch.cat(slots))
    assert torch.equal(layout.keys[1], torch.cat(positions))
    assert layout.span == 12  # 9 rounded up to 2·cp


@pytest.mark.parametrize(("change", "message"), [
    ({"heads_N": torch.tensor([0, 0, 5, 3])}, "slot 2: its head 5 is outside"),
    ({"heads_N": torch.tensor([1, 1, 0, 3]), "starts_N": torch.tensor([4, 0, 4, 0])},
     "slot 0 .a follower. comes before its head, slot 1"),
    ({"heads_N": torch.tensor([0, 0, 1, 3])}, "slot 2 reads slot 1, itself a follower"),
    ({"starts_N": torch.tensor([0, 4, 4, 2])}, "slot 3 starts at position 2 but reads no"),
])
def test_heads_and_followers_are_checked_naming_the_slot(change: dict, message: str) -> None:
    layout = dataclasses.replace(shared_row(), **change)
    with pytest.raises(ValueError, match=message):
        layout.check()


def test_spans_that_overlap_or_leave_a_gap_name_the_slot() -> None:
    layout = shared_row()
    slot = layout.slot_T.clone()
    slot[8] = 2  # slot 1's last token (its span is 7 … 8) claimed by slot 2
    with pytest.raises(ValueError, match="slot 1: token 8 of the row belongs to slot 2"):
        dataclasses.replace(layout, slot_T=slot).check()
    gap = torch.cat([layout.slot_T[:3], layout.slot_T[4:]])  # slot 0 misses a token
    with pytest.raises(ValueError, match=r"slot 0: token 6 of the row belongs to slot 1 .*gap"):
        dataclasses.replace(layout, slot_T=gap).check()


def test_positions_that_are_not_the_rows_name_the_slot() -> None:
    layout = shared_row()
    positions = layout.position_T.clone()
    positions[9] += 1  # slot 2's first token
    with pytest.raises(ValueError, match="slot 2: token 9 has position 5, the row's is 4"):
        layout.check(positions[None])
    with pytest.raises(ValueError, match="slot 2: token 9"):
        dataclasses.replace(layout, position_T=positions).check()


def _dense(layout: RowLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           window: int | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense_mask(window),
                                          enable_gqa=True)


@pytest.mark.parametrize("planted", [False, True])
def test_the_sdpa_pieces_compute_the_layouts_mask(planted: bool) -> None:
    """Runs, prefix keys in front and group masks (GQA, K/V at kv heads) equal SDPA under
    ``visible`` over the whole row, the planted prefix error included."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 6, 9, 9, 9, 5, 5, 40, 38, 37])
    starts = torch.tensor([0, 4, 4, 4, 4, 0, 0, 0, 20, 20])
    heads = torch.tensor([0, 0, 0, 0, 0, 5, 6, 7, 7, 7])
    layout = RowLayout.build(lengths, starts_N=starts, heads_N=heads, planted=planted)
    n = len(layout.slot_T)
    q = torch.randn(1, 4, n, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    pieces = plan_pieces(layout)
    assert {p.mask is not None for p in pieces} == {True, False}
    torch.testing.assert_close(pieces_attention(q, k, v, pieces, 0.0, None),
                               _dense(layout, q, k, v))
    expected = visible(torch.tensor(1), torch.tensor(5), torch.tensor(0), torch.tensor(4),
                       torch.tensor(0), layout.prefix_N[1])
    assert bool(expected) == planted  # the head's copy of slot 1's own first token


def test_a_window_shorter_than_the_row_cuts_the_dense_mask() -> None:
    layout = shared_row()
    mask, windowed = layout.dense_mask(), layout.dense_mask(window=3)
    q_pos, k_pos = layout.position_T[:, None], layout.position_T[None, :]
    assert torch.equal(windowed, mask & (q_pos - k_pos < 3))
    assert layout.span == 9 and torch.equal(layout.dense_mask(window=9), mask)
