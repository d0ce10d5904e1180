"""A sync's buckets gathered one collective per bucket (trainer/backends/fsdp/
bucket_gather.py) are byte for byte the whole weights cast and packed, on real gloo
ranks: 3 ranks shard the tiny model's rows unevenly (vocab 100 → 34, 34, 32)."""

from __future__ import annotations

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _buckets(rank: int, port: int, model_path: str, world_size: int) -> dict:
    from rollout.weight_bucket import pack_flat
    from trainer.backends.fsdp.worker import FSDPWorker
    from trainer.config import ObjectiveConfig, TrainerConfig

    worker = FSDPWorker(TrainerConfig(dp_size=world_size), ObjectiveConfig(), model_path,
                        rank, total_steps=1)
    worker.setup("127.0.0.1", port)
    state = worker.export_weights()  # the whole fp32 weights, on rank 0
    out: dict = {"rows": None}
    for dtype, bucket_mb in (("bfloat16", 0.02), ("float32", 256.0)):
        specs = worker.weight_bucket_specs(dtype, bucket_mb)
        sent = list(worker.weight_buckets(dtype, bucket_mb))
        out[dtype] = (len(specs), sent, None if state is None else
                      [pack_flat(bucket, state.__getitem__) for bucket in specs])
    out["rows"] = worker._shard_rows["model.embed_tokens.weight"]
    return out


@pytest.mark.slow
def test_one_gather_per_bucket_equals_the_whole_weights_cast_and_packed(
        tiny_model: str) -> None:
    ranks = run_ranks(_buckets, 3, tiny_model, 3)
    assert ranks[0]["rows"] == [34, 34, 32]  # uneven rows: the last rank holds fewer
    for dtype in ("bfloat16", "float32"):
        num_buckets, sent, expected = ranks[0][dtype]
        assert num_buckets == len(sent) and (num_buckets > 1) == (dtype == "bfloat16")
        for got, want in zip(sent, expected, strict=True):
            assert got.dtype == torch.uint8 and torch.equal(got, want)
        for other in ranks[1:]:  # only rank 0 gets the buckets
            assert other[dtype][1] == [None] * num_buckets
