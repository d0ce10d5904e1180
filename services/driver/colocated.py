"""The colocated fast path composed (``colocate: true``, transport ``in_process``): each
engine is a trainer rank's own process, generating from the weights that rank holds.

    services (this module)                          trainer
    ColocatedTrainerGroup ─ start_engines ─► ColocatedRank = engine verbs + FSDPWorker
                                                      │ reads the rank only through
                                                      ▼ trainer/transports/base.WeightSource
                          EngineHost ── ColocatedEngine (services/driver/colocated_engine.py)

Weights move by the in-process transport (services/driver/transports/in_process.py):
``EngineHost.stage`` on every rank, then ``ColocatedRank.receive_weights`` on the engines.

The trainer never imports an engine (one-way imports): the rank class that carries the
engine's verbs is made here, from the FSDP policy rank and an :class:`EngineHost` that
reads the rank's weights through the ``WeightSource`` protocol.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.base import EpisodeTurn, Generation
from services.driver.colocated_engine import ColocatedEngine, StageMode
from trainer.backends.fsdp.worker import FSDPWorker
from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.group import TrainerGroup
from trainer.memory import PeakMemory, phase_metrics
from trainer.rank import master_dtype
from trainer.transports.base import WeightSource


class EngineHost:
    """One rank's part in the colocated path: its engine (engine ranks only) fed from
    ``source``, and its share of every gather (every rank)."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self.engine: ColocatedEngine | None = None

    def start(self, config: TorchEngineConfig, tokenizer_path: str | None,
              engine_rank: int | None, synchronous: bool) -> None:
        """Collective: become engine ``engine_rank`` (None: only take part in the
        gathers), serving the weights held now as version 0. When ``synchronous``
        (rollout.async_steps 0) the engine aliases them if the trainer has one rank and
        the engine's dtype is the master weights', else stages each version in place;
        the async pipeline copies into reused sets (services/driver/colocated_engine.py)."""
        source = self.source
        mode: StageMode = "copy"
        if synchronous:
            same_dtype = getattr(torch, config.dtype) == master_dtype(source.compute_dtype)
            mode = ("alias" if source.config.world_size == 1 and same_dtype else "in_place")
        if engine_rank is not None:
            self.engine = ColocatedEngine(config, source.model_path, tokenizer_path,
                                          engine_rank, source.device, mode)
        names = [name for name, _ in source.engine_tensors(alias=False, gather=False)]
        if self.engine is not None:
            self.engine.check_names(names)
        self.stage(0)
        if self.engine is not None:
            self.engine.serve(0)

    def stage(self, version: int) -> dict[str, float]:
        """Collective: every rank gathers each weight once (none when aliased); an engine
        rank keeps them as ``version``, served when the manager's queue reaches it. This
        rank's time and bytes copied."""
        started = time.perf_counter()
        with PeakMemory(self.source.device) as peak:
            alias = self.engine is not None and self.engine.alias
            tensors = self.source.engine_tensors(alias=alias, gather=not alias)
            if self.engine is not None:
                copied = self.engine.stage(version, tensors)
                if self.source.config.world_size == 1:  # it read what the next step writes
                    self.engine.fence()
            else:  # no engine here: only this rank's part of each gather
                copied = 0
                for _ in tensors:
                    pass
        return {"perf/export_s": time.perf_counter() - started,
                "perf/sync_bytes": float(copied), **phase_metrics("sync", peak)}


class ColocatedRank(FSDPWorker):
    """The FSDP policy rank with the engine's verbs (what the rollout manager calls on an
    engine actor: ``generate``, ``ping``, ``receive_weights``, ``node_id``)."""

    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 rank: int, total_steps: int) -> None:
        super().__init__(config, objective, model_path, rank, total_steps)
        self.host = EngineHost(self)

    def start_engine(self, config: TorchEngineConfig, tokenizer_path: str | None,
                     engine_rank: int | None, synchronous: bool) -> None:
        self.host.start(config, tokenizer_path, engine_rank, synchronous)

    def receive_weights(self, version: int, shipment: None = None) -> int:
        """The engine's half of the in-process transport
        (services/driver/transports/in_process.py): serve the weights this rank staged
        as ``version`` from now on; a version never staged is refused (KeyError)."""
        assert self.host.engine is not None, "receive_weights: this rank has no engine"
        if shipment is not None:
            raise TypeError("colocated engine: weights come staged in this process, not "
                            "shipped")
        self.host.engine.serve(version)
        return version

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int,
                 turn: EpisodeTurn | None = None) -> list[Generation]:
        """The engine verb: one response per prompt from the weights served."""
        assert self.host.engine is not None, "generate: this rank has no engine"
        return self.host.engine.generate(prompt_ids, sampling, seed, turn)

    def ping(self) -> int:
        engine = self.host.engine
        return engine.weight_version if engine is not None else -1


COLOCATED_RANK = "services.driver.colocated:ColocatedRank"
"""The rank actor of a colocated job."""


class ColocatedTrainerGroup(TrainerGroup):
    """The policy's group whose ranks are also the engines."""

    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 total_steps: int, **kwargs: Any) -> None:
        super().__init__(config, objective, model_path, total_steps, worker=COLOCATED_RANK,
                         **kwargs)

    def start_engines(self, engine: TorchEngineConfig, tokenizer_path: str | None,
                      num_engines: int, synchronous: bool) -> list[ray.actor.ActorHandle]:
        """Ranks 0 … num_engines − 1 become torch engines serving their own weights; their
        actors, to hand to the rollout manager as its engines."""
        self.call_each(ColocatedRank.start_engine,
                       [(engine, tokenizer_path, rank if rank < num_engines else None,
                         synchronous) for rank in range(len(self.workers))])
        return self.workers[:num_engines]
