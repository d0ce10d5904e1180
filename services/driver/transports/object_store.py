"""Object-store transport, the driver's half: the ranks put the buckets in Ray's object
store (trainer/transports/object_store.py) and rank 0's shipment, a few refs stamped
with the version, goes to the receiver (the rollout manager, or one engine actor), whose
``receive_weights(version, shipment)`` has every engine map them in place.
"""

from __future__ import annotations

from typing import Any

from trainer.group import most
from trainer.transports.object_store import ObjectStoreSender


class ObjectStoreTransport:
    """Buckets through Ray's object store, on CPU or GPU, to any engine."""

    def __init__(self, trainer: Any, receiver: Any, dtype: str, bucket_mb: float) -> None:
        """``receiver``: an actor with ``receive_weights(version, shipment)`` (the
        rollout manager, rollout/engine_weights.py; or an engine, rollout/engines/)."""
        self.trainer, self.receiver = trainer, receiver
        self.sender = ObjectStoreSender(dtype, bucket_mb)

    def send_weights(self, version: int) -> tuple[Any, dict[str, float]]:
        answers = self.trainer.send_weights(ObjectStoreSender.send, self.sender, version)
        shipment = answers[0][0]
        return (self.receiver.receive_weights.remote(version, shipment),
                most([metrics for _, metrics in answers]))
