from __future__ import annotations

import pytest
import torch

from trainer.context_parallel import padded_length, zigzag_positions, zigzag_shard, zigzag_unshard


def test_zigzag_rank_holds_chunks_r_and_mirror() -> None:
    tokens = torch.arange(8)[None, :]  # cp=2 -> 4 chunks of 2
    assert zigzag_shard(tokens, 2, 0).tolist() == [[0, 1, 6, 7]]
    assert zigzag_shard(tokens, 2, 1).tolist() == [[2, 3, 4, 5]]


@pytest.mark.parametrize("cp_size", [1, 2, 3])
@pytest.mark.parametrize("seq_len", [1, 5, 12, 13])
def test_shards_cover_every_token_once_and_pad_with_zero(cp_size: int, seq_len: int) -> None:
    values = torch.arange(1, seq_len + 1, dtype=torch.float64)[None, :].repeat(2, 1)
    shards = [zigzag_shard(values, cp_size, r, dim=1) for r in range(cp_size)]
    assert sum(float(s.sum()) for s in shards) == float(values.sum())
    assert all(s.shape[1] == padded_length(seq_len, cp_size) // cp_size for s in shards)
    torch.testing.assert_close(zigzag_unshard(shards, seq_len, dim=1), values)
    positions = torch.cat([zigzag_positions(seq_len, cp_size, r) for r in range(cp_size)])
    assert sorted(positions.tolist()) == list(range(padded_length(seq_len, cp_size)))
