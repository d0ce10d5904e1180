"""In-process transport (the colocated fast path, services/driver/colocated.py): both
halves here, since the engine lives in the rank's own process and the trainer hosts no
engine. Every rank stages weights ``version`` for its engine (one rank, synchronous:
aliased, nothing copied; else in place or into reused buffer sets); the engines serve
them when the manager's queue reaches ``receive_weights(version)``, after the rollouts
asked for before. A version never staged is refused there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.group import most

if TYPE_CHECKING:
    from services.driver.colocated import ColocatedRank


@dataclass(frozen=True)
class InProcessSender:
    """The ranks' half: stage the weights for the engine in this process."""

    def send(self, rank: ColocatedRank, version: int) -> tuple[None, dict[str, float]]:
        """Collective: every rank gathers each weight once (none when aliased); an engine
        rank keeps them as ``version``. This rank's time, bytes copied, peak memory."""
        return None, rank.host.stage(version)


class InProcessTransport:
    """The driver's half: stage on every rank, then the manager has each engine serve."""

    def __init__(self, trainer: Any, manager: Any) -> None:
        """``trainer``: the colocated group (its ranks are ``ColocatedRank``s)."""
        self.trainer, self.manager = trainer, manager
        self.sender = InProcessSender()

    def send_weights(self, version: int) -> tuple[Any, dict[str, float]]:
        answers = self.trainer.send_weights(InProcessSender.send, self.sender, version)
        return (self.manager.receive_weights.remote(version),
                most([metrics for _, metrics in answers]))
