"""NCCL transport, the driver's half: trainer rank 0 and every SGLang server join one
weight-update group the first time (POST /init_weights_update_group on each while rank
0 hosts the rendezvous), then per version the servers are told the buckets' specs
(/update_weights_from_distributed, queued behind the rollouts in flight) and wait in each
bucket's broadcast while the ranks send them (trainer/transports/nccl.py). GPU only.
"""

from __future__ import annotations

from typing import Any

from services.driver.transports import Fetch
from trainer.group import most
from trainer.transports.nccl import NcclSender

WEIGHT_GROUP = "tally_weights"
"""The weight-update group's name, on both ends."""


class NcclTransport:
    """NCCL broadcast from trainer rank 0 to every SGLang server."""

    def __init__(self, trainer: Any, manager: Any, dtype: str, bucket_mb: float,
                 fetch: Fetch) -> None:
        self.trainer, self.manager, self.fetch = trainer, manager, fetch
        self.sender = NcclSender(dtype, bucket_mb, WEIGHT_GROUP)
        self.joined = False

    def _join(self) -> None:
        """Once per start of the actors: the servers and rank 0 meet."""
        address, port = self.trainer.send_weights(NcclSender.address, self.sender,
                                                  rank0=True)[0]
        world_size = 1 + self.fetch(self.manager.num_weight_ranks.remote(),
                                    "num_weight_ranks")
        joined = self.manager.init_weights_update_group.remote(address, port, WEIGHT_GROUP,
                                                               world_size)
        self.trainer.send_weights(NcclSender.join, self.sender, address, port, world_size,
                                  rank0=True)
        self.fetch(joined, "init_weights_update_group")
        self.joined = True

    def send_weights(self, version: int) -> tuple[Any, dict[str, float]]:
        if not self.joined:
            self._join()
        specs = self.trainer.send_weights(NcclSender.specs, self.sender)[0]
        load = self.manager.update_weights_from_distributed.remote(specs, version,
                                                                   WEIGHT_GROUP)
        answers = self.trainer.send_weights(NcclSender.send, self.sender, version)
        return load, most([metrics for _, metrics in answers])
