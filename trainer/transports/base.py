"""What a weight sender reads from a policy rank, and the shape of a sender's steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from rollout.weight_bucket import TensorSpec
from trainer.config import TrainerConfig


@runtime_checkable
class BucketSource(Protocol):
    """A policy rank as its weight senders see it: the buckets of a sync, in order."""

    rank: int
    config: TrainerConfig
    device: torch.device

    def weight_bucket_specs(self, dtype: str, bucket_mb: float
                            ) -> list[tuple[TensorSpec, ...]]:
        """The buckets of one sync, in send order (the same on every rank)."""
        ...

    def weight_buckets(self, dtype: str, bucket_mb: float, device: str = "cpu"
                       ) -> Iterator[torch.Tensor | None]:
        """Collective: each bucket's flat uint8 buffer on ``device`` on rank 0 (None on
        the others), in the order of ``weight_bucket_specs``."""
        ...

    def full_model_bytes(self, dtype: str) -> float | None:
        """What a sync of the whole model would send where a sync sends less (LoRA)."""
        ...


SenderStep = Callable[..., Any]
"""One step of a sender's rank side, unbound (``NcclSender.join``): called as
``step(sender, rank, *args)`` on the rank, with the sender the rank holds."""
