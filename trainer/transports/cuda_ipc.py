"""CUDA IPC transport, the ranks' half: rank 0 packs one bucket at a time on its GPU,
keeps it alive and hands its CUDA IPC handles to the SGLang server on the same GPU,
which copies it (POST /update_weights_from_tensor; the driver's half is
services/driver/transports/cuda_ipc.py) before the next bucket is shared.

For a server on the trainer's own GPUs, POST /update_weights_from_tensor carries CUDA IPC
handles instead: ``serialize_named_tensors`` makes its ``serialized_named_tensors``, one
base64 string per TP rank (rank k reads entry k). sglang is imported there only, inside
the function: it exists on GPU nodes only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from rollout.weight_bucket import DTYPES, TensorSpec
from trainer.memory import PeakMemory, phase_metrics
from trainer.transports.base import BucketSource


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]],
                            tp_size: int) -> list[str]:
    """``serialized_named_tensors`` of POST /update_weights_from_tensor (load_format
    None) for a server of ``tp_size`` ranks on this node's GPUs: per rank, one base64
    string of sglang's MultiprocessingSerializer of the (name, CUDA tensor) list; CUDA IPC
    handles, not the data. Each rank gets its own payload, so each handle's reference
    count drops once that rank is done with it. The tensors must stay alive until the
    server has answered."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    # Handles name the device by UUID, not index: the server's CUDA_VISIBLE_DEVICES may
    # number the GPUs otherwise (SGLang's own senders patch the same way).
    monkey_patch_torch_reductions()
    payload = [(name, tensor.detach()) for name, tensor in named_tensors]
    return [MultiprocessingSerializer.serialize(payload, output_str=True)
            for _ in range(tp_size)]


@dataclass(unsafe_hash=True)
class CudaIpcSender:
    """Bucket by bucket, rank 0's GPU copy shared with a server of ``tp_size`` ranks."""

    dtype: str
    bucket_mb: float
    tp_size: int
    sharing: Iterator[tuple[tuple[TensorSpec, ...], torch.Tensor | None]] | None = field(
        default=None, compare=False, repr=False)
    """This sync's buckets still to share (the rank's own copy)."""
    shared: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """The bucket the server is reading now, kept alive until the next is asked for."""

    def specs(self, rank: BucketSource) -> list:
        """Collective: the buckets of one sync (the driver asks for each by index)."""
        return rank.weight_bucket_specs(self.dtype, self.bucket_mb)

    def share(self, rank: BucketSource, index: int
              ) -> tuple[list[str] | None, dict[str, float]]:
        """Collective: bucket ``index`` packed on rank 0's GPU and kept alive there; its
        CUDA IPC handles for /update_weights_from_tensor (rank 0; None elsewhere)."""
        if index == 0:
            self.sharing = zip(rank.weight_bucket_specs(self.dtype, self.bucket_mb),
                               rank.weight_buckets(self.dtype, self.bucket_mb,
                                                   str(rank.device)), strict=True)
        assert self.sharing is not None, "cuda_ipc weight sync: bucket 0 comes first"
        self.shared = None  # the server copied the previous bucket: free it first
        with PeakMemory(rank.device) as peak:
            specs, self.shared = next(self.sharing)
        if self.shared is None:
            return None, phase_metrics("sync", peak)
        views = [(spec.name, self.shared[spec.offset:spec.offset + spec.num_bytes]
                  .view(DTYPES[spec.dtype]).view(spec.shape)) for spec in specs]
        return serialize_named_tensors(views, self.tp_size), phase_metrics("sync", peak)

    def release(self, rank: BucketSource) -> None:
        """The last shared bucket is loaded: free it."""
        self.shared, self.sharing = None, None
