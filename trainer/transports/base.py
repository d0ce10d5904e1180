"""What a weight transport reads from a policy rank: its buckets (``BucketSource``, the
senders here) or, for an engine in the rank's own process, its full tensors by name
(``WeightSource``, the colocated path composed in services/driver/colocated.py); and the
shape of a sender's steps. The trainer imports nothing of an engine's: these few names
are the whole of what the other side reads."""

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


@runtime_checkable
class WeightSource(Protocol):
    """A rank whose full weights can be read by name, in its own process."""

    config: TrainerConfig
    model_path: str
    device: torch.device
    compute_dtype: torch.dtype

    def engine_tensors(self, alias: bool, gather: bool = True
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective when ``gather``: every parameter (a tied one once) and buffer by
        name, full; ``alias``: this rank's own storage (one rank only)."""
        ...


SenderStep = Callable[..., Any]
"""One step of a sender's rank side, unbound (``NcclSender.join``): called as
``step(sender, rank, *args)`` on the rank, with the sender the rank holds."""
