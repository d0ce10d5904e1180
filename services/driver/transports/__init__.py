"""The weight transports, the driver's halves, one file each behind one interface:
``send_weights(version)`` starts sending weights ``version`` and returns the engines'
load (a ref to wait for) and the sync's metrics. ``weight_sync.WeightSync`` picks one
from ``trainer.weight_sync.transport`` once (``transport_for``) and calls only this.

    transport     driver's half     ranks' half (trainer/)     engines' half
    object_store  object_store.py   transports/object_store.py  receive_weights (buckets)
    nccl          nccl.py           transports/nccl.py          SGLang, distributed
    cuda_ipc      cuda_ipc.py       transports/cuda_ipc.py      SGLang, from tensor
    in_process    in_process.py     (in_process.py: the rank hosts the engine)  receive_weights

The ranks' halves are steps the policy group runs with ``TrainerGroup.send_weights``;
the engines' halves are the rollout manager's verbs (rollout/engine_weights.py), queued
behind the rollouts already asked for. ``disk`` is the object store's: an SGLang engine
writes the buckets it receives to disk for its server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

Fetch = Callable[[Any, str], Any]
"""``fetch(ref, verb)``: an actor call's answer within the rollout call timeout."""


class WeightTransport(Protocol):
    def send_weights(self, version: int) -> tuple[Any, dict[str, float]]:
        """Start sending weights ``version``: the engines' load (a ref to wait for) and
        the sync's metrics (time, bytes, peak memory: the most of any rank)."""
        ...


def transport_for(kind: str, trainer: Any, manager: Any, dtype: str, bucket_mb: float,
                  fetch: Fetch) -> WeightTransport:
    """The transport ``trainer.weight_sync.transport`` names (``auto`` resolved by
    JobConfig.weight_transport), between the policy's group and the rollout manager."""
    if kind == "in_process":
        from services.driver.transports.in_process import InProcessTransport
        return InProcessTransport(trainer, manager)
    if kind in ("object_store", "disk"):
        from services.driver.transports.object_store import ObjectStoreTransport
        return ObjectStoreTransport(trainer, manager, dtype, bucket_mb)
    if kind == "nccl":
        from services.driver.transports.nccl import NcclTransport
        return NcclTransport(trainer, manager, dtype, bucket_mb, fetch)
    if kind == "cuda_ipc":
        from services.driver.transports.cuda_ipc import CudaIpcTransport
        return CudaIpcTransport(trainer, manager, dtype, bucket_mb, fetch)
    raise ValueError(f"trainer.weight_sync.transport: unknown transport {kind!r}")
