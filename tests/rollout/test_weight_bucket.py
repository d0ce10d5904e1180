"""The bucket format both sides of a weight sync share: buckets hold whole tensors and
respect their size, a bf16 round trip is bit-exact, and a malformed bucket is refused
naming the bucket and the tensor; a shipment hands its buckets only to the version it was
stamped with."""

from __future__ import annotations

import pytest
import torch

from rollout.weight_bucket import (
    TensorSpec,
    WeightBucket,
    WeightShipment,
    WeightVersionMismatch,
    check_buckets,
    pack_bucket,
    plan_buckets,
)

SHAPES = [("a", (10, 10)), ("b", (300,)), ("huge", (40, 40)), ("c", (5,))]


def test_buckets_hold_whole_tensors_within_their_size() -> None:
    plans = plan_buckets(SHAPES, "bfloat16", bucket_bytes=800)
    assert [[spec.name for spec in plan] for plan in plans] == [["a", "b"], ["huge"], ["c"]]
    assert sum(spec.num_bytes for spec in plans[0]) == 2 * (100 + 300) <= 800
    assert [spec.offset for spec in plans[0]] == [0, 200]  # bytes, back to back
    assert plans[1][0].num_bytes == 3200  # larger than a bucket: one of its own


def test_a_bf16_bucket_round_trips_bit_for_bit() -> None:
    tensors = {name: torch.randn(shape) for name, shape in SHAPES}
    for plan in plan_buckets(SHAPES, "bfloat16", bucket_bytes=1 << 20):
        bucket = pack_bucket(plan, tensors)
        assert bucket.num_bytes == 2 * sum(t.numel() for t in tensors.values())
        for name, view in bucket.tensors().items():
            assert view.dtype == torch.bfloat16
            assert torch.equal(view, tensors[name].bfloat16()), name


def test_malformed_buckets_are_refused_naming_bucket_and_tensor() -> None:
    tensors = {name: torch.randn(shape) for name, shape in SHAPES}
    expected = dict(SHAPES)
    good = [pack_bucket(plan, tensors) for plan in plan_buckets(SHAPES, "float32", 1000)]
    check_buckets(good, expected)
    with pytest.raises(KeyError, match="weight bucket 1: unknown parameter 'a'"):
        check_buckets([good[1], good[0]], {k: v for k, v in expected.items() if k != "a"})
    with pytest.raises(ValueError, match="weight bucket 1: a sent twice"):
        check_buckets([good[0], good[0]], expected)
    with pytest.raises(ValueError, match=r"weight bucket 1: b has shape \(300,\), expected"):
        check_buckets(good, {**expected, "b": (3, 100)})
    short = WeightBucket(good[0].specs, good[0].data[:10])
    with pytest.raises(ValueError, match="weight bucket 0: 10 bytes of uint8"):
        check_buckets([short], expected)
    assert TensorSpec("t", (2, 3), "float16").num_bytes == 12


def test_a_shipment_gives_its_buckets_to_its_own_version_only() -> None:
    buckets = tuple(pack_bucket(plan, {n: torch.randn(s) for n, s in SHAPES})
                    for plan in plan_buckets(SHAPES, "float32", bucket_bytes=800))
    shipment = WeightShipment(7, buckets)
    assert shipment.for_version(7) is buckets
    for other in (6, 8):
        with pytest.raises(WeightVersionMismatch, match=f"weights {other}, the buckets sent "
                                                        f"are weights 7"):
            shipment.for_version(other)
