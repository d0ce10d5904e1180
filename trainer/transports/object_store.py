"""Object-store transport, the ranks' half: every rank takes part in gathering each
bucket, rank 0 puts each one in Ray's object store as soon as it is packed and drops its
own copy (it never holds two), and answers a :class:`WeightShipment` of their refs
stamped with the version. The engines map the buckets in place
(services/driver/transports/object_store.py carries the shipment to them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rollout.weight_bucket import WeightBucket, WeightShipment
from trainer.memory import PeakMemory, phase_metrics
from trainer.transports.base import BucketSource


@dataclass(frozen=True)
class ObjectStoreSender:
    """Buckets of ``bucket_mb`` in the engine's ``dtype`` through Ray's object store."""

    dtype: str
    bucket_mb: float

    def send(self, rank: BucketSource, version: int
             ) -> tuple[WeightShipment | None, dict[str, float]]:
        """Collective: (rank 0's shipment of weights ``version``, None elsewhere; this
        rank's time, bytes and peak memory)."""
        import ray

        started, refs = time.perf_counter(), []
        plan = rank.weight_bucket_specs(self.dtype, self.bucket_mb)
        with PeakMemory(rank.device) as peak:
            for specs, flat in zip(plan, rank.weight_buckets(self.dtype, self.bucket_mb),
                                   strict=True):
                if flat is not None:
                    refs.append(ray.put(WeightBucket(specs, flat.numpy())))
                del flat
        sent = float(sum(spec.num_bytes for bucket in plan for spec in bucket))
        receipt = {"perf/export_s": time.perf_counter() - started,
                   "perf/sync_bytes": sent, **phase_metrics("sync", peak)}
        if (whole := rank.full_model_bytes(self.dtype)) is not None:  # adapters (LoRA)
            receipt["perf/sync_share_of_full"] = sent / whole
        return (WeightShipment(version, tuple(refs)) if rank.rank == 0 else None), receipt
