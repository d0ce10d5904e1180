"""CUDA IPC transport, the driver's half: one bucket at a time, rank 0 shares its GPU
copy (trainer/transports/cuda_ipc.py) and the SGLang server on the same GPU copies it
(/update_weights_from_tensor, the version on the last bucket: it flips then) before the
next is packed, so rank 0 holds one bucket beyond its shard. GPU only.
"""

from __future__ import annotations

from typing import Any

from services.driver.transports import Fetch
from trainer.group import most
from trainer.transports.cuda_ipc import CudaIpcSender


class CudaIpcTransport:
    """CUDA IPC handles of one bucket at a time to the SGLang server on rank 0's GPU."""

    def __init__(self, trainer: Any, manager: Any, dtype: str, bucket_mb: float,
                 fetch: Fetch) -> None:
        self.trainer, self.manager, self.fetch = trainer, manager, fetch
        self.dtype, self.bucket_mb = dtype, bucket_mb

    def send_weights(self, version: int) -> tuple[Any, dict[str, float]]:
        tp_size = self.fetch(self.manager.num_weight_ranks.remote(), "num_weight_ranks")
        sender = CudaIpcSender(self.dtype, self.bucket_mb, tp_size)
        count = len(self.trainer.send_weights(CudaIpcSender.specs, sender)[0])
        metrics: dict[str, float] = {}
        for index in range(count):  # the server copies a bucket before the next
            answers = self.trainer.send_weights(CudaIpcSender.share, sender, index)
            metrics = most([rank_metrics for _, rank_metrics in answers])
            last = index == count - 1
            self.fetch(self.manager.update_weights_from_tensor.remote(
                answers[0][0], version if last else None), "update_weights_from_tensor")
        self.trainer.send_weights(CudaIpcSender.release, sender, rank0=True)
        return self.manager.ping.remote(), metrics
