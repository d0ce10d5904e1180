"""Rows of the torch engine's batch cache (rollout/engines/kv_rows.py) against
transformers' own DynamicLayer: what attention reads is the same tensor."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from rollout.engines.kv_rows import GrowingLayer, prefill_groups


def test_a_growing_layer_holds_what_a_dynamic_layer_holds() -> None:
    generator = torch.Generator().manual_seed(0)
    growing, dynamic = GrowingLayer(room=2), DynamicLayer()
    rows = 4
    for step, width in enumerate([5, 1, 1, 1, 3, 1]):  # past its room: it grows
        keys, values = (torch.randn(rows, 2, width, 8, generator=generator) for _ in range(2))
        mine, theirs = growing.update(keys, values), dynamic.update(keys, values)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        if step == 3:  # rows 0 and 2 kept, as when rows finish
            growing.batch_select_indices(torch.tensor([0, 2]))
            dynamic.batch_select_indices(torch.tensor([0, 2]))
            rows = 2
    assert growing.get_seq_length() == dynamic.get_seq_length() == 12
    assert torch.equal(growing.keys, dynamic.keys)
    assert growing.key_buffer.shape[-2] >= 12


def test_prefill_groups_bound_the_padding() -> None:
    assert prefill_groups([300, 20, 290, 25, 160]) == [[0, 2, 4], [3, 1]]
    assert prefill_groups([60, 3, 40]) == [[0, 2, 1]]  # short: one forward
    assert prefill_groups([]) == []
