"""What a trainer rank offers whoever serves its weights in its own process.

The trainer never hosts an inference engine (docs: ARCHITECTURE.md, one-way imports): the
colocated fast path composes an engine with a rank in ``services/driver/colocated.py``.
This protocol is the whole of what that composition reads from the rank, so the services
side depends on these few names, never on a backend's internals, and the trainer imports
nothing of the engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from trainer.config import TrainerConfig


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
