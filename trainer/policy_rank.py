"""The policy's rank: the head that owns log π_T and the pg/KL/entropy terms
(trainer/objective.py), and the policy's weights out to the engines.

    export_weight_buckets ► all ranks ─ weight_buckets, rank 0 puts each in the object store
    broadcast_weight_buckets / share_weight_bucket: the GPU transports (rank 0 meets SGLang)

Backends: ``backends/fsdp/worker.py`` (FSDPWorker), ``backends/megatron/worker.py``.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rollout.weight_bucket import DTYPES
from trainer.memory import PeakMemory, phase_metrics
from trainer.worker import BatchRank

if TYPE_CHECKING:
    from rollout.batch import RolloutBatch
    from rollout.weight_bucket import TensorSpec
    from trainer.step_plan import StepPlan


class PolicyRank(BatchRank):
    """A rank of the policy: log-probs and the weight sync's senders."""

    @abc.abstractmethod
    def log_probs(self, batch: RolloutBatch, plan: StepPlan) -> torch.Tensor | None:
        """Collective, no update: log π_T [N, S] of every response token under the current
        policy, aligned with ``input_ids`` and 0 off the loss mask; rank 0 returns it."""

    def export_weight_buckets(self, dtype: str, bucket_mb: float
                              ) -> tuple[dict[str, float], list[Any] | None]:
        """Collective: (this rank's sync time and peak memory, rank 0's list of object refs
        of its buckets) as two Ray returns. Rank 0 puts each bucket in the object store as
        soon as it is packed and drops its own copy, so it never holds two."""
        import ray

        from rollout.weight_bucket import WeightBucket

        started, refs = time.perf_counter(), []
        plan = self.weight_bucket_specs(dtype, bucket_mb)
        with PeakMemory(self.device) as peak:
            for specs, flat in zip(plan, self.weight_buckets(dtype, bucket_mb), strict=True):
                if flat is not None:
                    refs.append(ray.put(WeightBucket(specs, flat.numpy())))
                del flat
        sent = float(sum(spec.num_bytes for bucket in plan for spec in bucket))
        receipt = {"perf/export_s": time.perf_counter() - started,
                   "perf/sync_bytes": sent, **phase_metrics("sync", peak)}
        if (whole := self.full_model_bytes(dtype)) is not None:  # adapters only (LoRA)
            receipt["perf/sync_share_of_full"] = sent / whole
        return receipt, refs if self.rank == 0 else None

    def full_model_bytes(self, dtype: str) -> float | None:
        """What a sync of the whole model in ``dtype`` would send, where a sync sends less
        (LoRA's adapters); None where it sends the whole model."""
        return None

    def weight_bucket_specs(self, dtype: str, bucket_mb: float
                            ) -> list[tuple[TensorSpec, ...]]:
        """The buckets of one sync, in send order (the same on every rank)."""
        from rollout.weight_bucket import plan_buckets

        shapes = self._weight_shapes()
        return plan_buckets(shapes, dtype, int(bucket_mb * 2**20))

    def _weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        if not hasattr(self, "_gathered_shapes"):  # the backend gathers to learn them once
            state = self.export_weights()
            holder = [None if state is None else [(n, tuple(t.shape))
                                                  for n, t in state.items()]]
            dist.broadcast_object_list(holder, src=0)
            self._gathered_shapes = holder[0]
        return self._gathered_shapes

    def weight_buckets(self, dtype: str, bucket_mb: float, device: str = "cpu"
                       ) -> Iterator[torch.Tensor | None]:
        """Collective: the flat buckets of ``weight_bucket_specs`` in order, on rank 0
        (None elsewhere). This default gathers the whole model on rank 0 first
        (``export_weights``: the Megatron backend); FSDP streams a bucket at a time."""
        from rollout.weight_bucket import pack_flat

        specs = self.weight_bucket_specs(dtype, bucket_mb)
        state = self.export_weights()
        for bucket in specs:
            yield None if state is None else pack_flat(bucket, state.__getitem__, device)

    # GPU weight transports (trainer/weight_broadcast.py): rank 0 meets the SGLang servers.

    def weight_group_address(self) -> tuple[str, int]:
        """Rank 0: where the weight-update group's rendezvous will listen (this node, a
        port free now: rank 0 binds it in ``join_weight_group``)."""
        import socket

        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_weight_group(self, address: str, port: int, world_size: int,
                          group_name: str) -> None:
        """Rank 0: host and join the group while the servers join it."""
        from trainer.weight_broadcast import init_weight_update_group

        self._weight_group = init_weight_update_group(
            address, port, world_size, group_name,
            timeout_s=self.config.collective_timeout_s)

    def broadcast_weight_buckets(self, dtype: str, bucket_mb: float) -> dict[str, float]:
        """Collective: each bucket packed on rank 0's GPU and broadcast to the servers as
        one flattened tensor (their /update_weights_from_distributed receives it)."""
        from trainer.weight_broadcast import broadcast_bucket

        started = time.perf_counter()
        with PeakMemory(self.device) as peak:
            for flat in self.weight_buckets(dtype, bucket_mb, device=str(self.device)):
                if flat is not None:
                    broadcast_bucket(self._weight_group, [flat], flattened=True)
                del flat
        return {"perf/export_s": time.perf_counter() - started, **phase_metrics("sync", peak)}

    def share_weight_bucket(self, index: int, dtype: str, bucket_mb: float, tp_size: int
                            ) -> tuple[list[str] | None, dict[str, float]]:
        """Collective: bucket ``index`` packed on rank 0's GPU and kept alive there; its
        CUDA IPC handles for /update_weights_from_tensor (rank 0; None elsewhere)."""
        from trainer.weight_broadcast import serialize_named_tensors

        if index == 0:
            self._sharing = zip(self.weight_bucket_specs(dtype, bucket_mb),
                                self.weight_buckets(dtype, bucket_mb, str(self.device)),
                                strict=True)
        self._shared = None  # the server copied the previous bucket: free it first
        with PeakMemory(self.device) as peak:
            specs, self._shared = next(self._sharing)
        if self._shared is None:
            return None, phase_metrics("sync", peak)
        views = [(spec.name, self._shared[spec.offset:spec.offset + spec.num_bytes]
                  .view(DTYPES[spec.dtype]).view(spec.shape)) for spec in specs]
        return serialize_named_tensors(views, tp_size), phase_metrics("sync", peak)

    def release_shared_bucket(self) -> None:
        """Rank 0: the last shared bucket is loaded; free it."""
        self._shared = None
