"""The rollout manager's weight verbs: every engine loads new weights, by whichever
transport the driver chose (services/driver/weight_sync.py), and the manager's weight
version follows. A mixin of :class:`rollout.manager.RolloutManager` (it holds
``pool`` and ``weight_version``).

Each verb that can be sent again to one engine (an object-store shipment or ref, a
folder on disk) leaves the pool its ``reload``: a replacement of a lost engine
(rollout/engine_pool.py) loads the current weights with it. The shipment's refs stay
held until the next version, so one version's buckets more stay in the object store.
The verbs of SGLang's weight-update group (NCCL) and of CUDA IPC cannot be sent to one
engine alone: after one of them a lost engine restarts the job, as it always did."""

from __future__ import annotations

from collections.abc import Mapping

import ray
import torch

from rollout.engine_pool import EnginePool
from rollout.weight_bucket import WeightShipment


class EngineWeights:
    """Weights into the engines; ``weight_version`` counts what they serve."""

    pool: EnginePool
    weight_version: int

    def update_weights(self, weights: Mapping[str, torch.Tensor] | ray.ObjectRef | list,
                       version: int | None = None) -> int:
        """Send new weights to every engine; returns the new weight version (``version``
        when given: the driver numbers weights by the rollouts trained into them, which a
        resume keeps; else one more than before).

        `weights` is a state dict (put into the object store once here), an ObjectRef of
        one, or ``[ref]``. From a driver, call ``manager.update_weights.remote([ref])``:
        a bare top-level ref would be fetched into this actor first, the list is not, so
        each engine reads the one stored copy directly.
        """
        if isinstance(weights, list | tuple):
            (ref,) = weights
        elif isinstance(weights, ray.ObjectRef):
            ref = weights
        else:
            ref = ray.put(dict(weights))
        self.pool.on_each(lambda engine: engine.update_weights.remote(ref))
        self.pool.reload = lambda engine: engine.update_weights.remote(ref)
        self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version

    def receive_weights(self, version: int, shipment: WeightShipment | None = None) -> int:
        """Every engine receives weights ``version`` (services/driver/transports/): the
        object store's ``shipment`` of bucket refs, loaded by each engine; None: a
        colocated engine serves what its rank staged as ``version``. Each engine refuses
        a version it was not sent."""
        self.pool.on_each(lambda engine: engine.receive_weights.remote(version, shipment))
        if shipment is not None:  # None: colocated, whose engines are never replaced
            self.pool.reload = lambda engine: engine.receive_weights.remote(version, shipment)
        self.weight_version = version
        return version

    def num_weight_ranks(self) -> int:
        """GPUs the SGLang servers add to a weight-update group, over all engines."""
        return sum(self.pool.on_each(lambda engine: engine.num_weight_ranks.remote()))

    def init_weights_update_group(self, address: str, port: int, group_name: str,
                                  world_size: int) -> None:
        """Every server joins trainer rank 0's weight-update group (rank 0 joins too,
        meanwhile); server k's ranks follow those of the servers before it."""
        self.pool.replayable = False  # a replacement could not join the group
        engines = self.pool.engines
        sizes = ray.get([engine.num_weight_ranks.remote() for engine in engines])
        offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]
        ray.get([engine.init_weights_update_group.remote(address, port, offset, world_size,
                                                         group_name)
                 for engine, offset in zip(engines, offsets, strict=True)])

    def update_weights_from_distributed(self, buckets: list, version: int,
                                        group_name: str) -> int:
        """Every server receives the buckets trainer rank 0 broadcasts, in order."""
        self.pool.replayable = False
        ray.get([engine.update_weights_from_distributed.remote(buckets, version, group_name,
                                                               True)
                 for engine in self.pool.engines])
        self.weight_version = version
        return version

    def update_weights_from_tensor(self, serialized: list[str], version: int | None) -> None:
        """The colocated server loads one bucket from CUDA IPC handles (``version`` on the
        last bucket: it flips then)."""
        self.pool.replayable = False  # the handles are of this one moment's tensors
        ray.get([engine.update_weights_from_tensor.remote(serialized, version)
                 for engine in self.pool.engines])
        if version is not None:
            self.weight_version = version

    def update_weights_from_disk(self, path: str) -> int:
        """Have every engine load a saved HF checkpoint directory."""
        self.pool.on_each(lambda engine: engine.update_weights_from_disk.remote(path))
        self.pool.reload = lambda engine: engine.update_weights_from_disk.remote(path)
        self.weight_version += 1
        return self.weight_version
