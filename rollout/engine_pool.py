"""The rollout manager's engines by rank, which of them are lost, and the calls that
outlive a lost one.

    shard r (rank r's slice, rank r's seed) ─► engine r, or a live engine if r is lost
          │ the actor died (RayActorError) or no answer within rollout.generate_timeout_s
          ▼
    engine r lost (killed if it hung) ─► shard r sent again, same slice and seed, to a live
    engine ─► the same samples (same weights, same seed) ─► the step's N stays whole
          ▼
    the driver asks ``lost()`` each step, the gang starts a replacement in rank r's bundle,
    the manager's ``replace_engine`` loads the current weights into it (``reload``)

Only an engine pool the manager owns is elastic: on the colocated fast path the engines
are trainer ranks, whose loss restarts the job, so a lost one raises as before. A loss
also raises when no live engine is left, or when the engines' weights came by a transport
that cannot be sent again to one engine (NCCL, CUDA IPC): the job restarts from its
checkpoint then, as it always did.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

ENGINE_LOST = (ray.exceptions.RayActorError,)
"""A dead or unreachable actor (ActorDiedError and ActorUnavailableError are kinds of it);
an exception an engine raises itself is no loss: it stops the job as before."""

Send = Callable[[Any], ray.ObjectRef]
"""The call of a shard on a given engine actor."""


@dataclass(frozen=True)
class Shard:
    """One engine's share of a call: rank ``rank``'s slice, sent with rank ``rank``'s seed
    (baked into ``send``) to whichever engine serves it."""

    rank: int
    bounds: tuple[int, int]
    send: Send


class EnginePool:
    """Engine actors by rank; a lost rank's work goes to the live ones until it is replaced."""

    def __init__(self, engines: list[Any], elastic: bool, timeout_s: float) -> None:
        """``elastic``: the manager owns these engines (not trainer ranks); ``timeout_s``:
        rollout.generate_timeout_s, past which a generate call's engine is lost."""
        self.engines = list(engines)
        self.elastic, self.timeout_s = elastic, timeout_s
        self.reload: Callable[[Any], ray.ObjectRef] | None = None
        """The current weights into one new engine (None: the engines serve the model
        they loaded)."""
        self.replayable = True
        """False once weights came by a transport that cannot be sent to one engine."""
        self._lost: dict[int, str] = {}
        """Rank -> the actor id of its lost engine, until replaced."""
        self._lock = threading.Lock()  # lost() answers from another thread (the manager's)
        self.events: list[tuple[str, str]] = []
        """``engine_lost`` events not yet handed on with a batch."""

    def live(self) -> list[tuple[int, Any]]:
        return [(rank, e) for rank, e in enumerate(self.engines) if rank not in self._lost]

    def lost(self) -> list[tuple[int, str]]:
        """(rank, actor id) of each lost engine not yet replaced."""
        with self._lock:
            return sorted(self._lost.items())

    def serving(self, rank: int) -> Any:
        """The engine that runs rank ``rank``'s shard: its own, or (lost) a live one."""
        if rank not in self._lost:
            return self.engines[rank]
        live = self.live()
        return live[rank % len(live)][1]

    def lose(self, engine: Any, why: str, err: BaseException) -> None:
        """Take ``engine`` for lost (killed, if it hung); ``err`` is raised instead when
        the pool cannot go on without it (not elastic, no live engine left, weights it
        could not be sent again)."""
        rank = next((r for r, e in enumerate(self.engines)
                     if e._actor_id == engine._actor_id), None)
        if rank is None or rank in self._lost:
            return  # reported already (another of its calls)
        if not self.elastic or not self.replayable or len(self.live()) <= 1:
            raise err
        ray.kill(engine, no_restart=True)  # a hung one frees its bundle; a dead one: no-op
        with self._lock:
            self._lost[rank] = engine._actor_id.hex()
        self.events.append(("engine_lost", f"engine {rank} lost ({why}); its calls go to "
                                           "the live engines with the seeds it was given "
                                           "until it is replaced"))

    def as_done(self, shards: list[Shard]) -> Iterator[tuple[Shard, Any]]:
        """Each shard's answer as its engine finishes it; a shard whose engine is lost is
        sent again to a live engine (its slice and seed unchanged)."""
        pending: dict[ray.ObjectRef, tuple[Shard, Any, float]] = {}

        def send(shard: Shard) -> None:
            engine = self.serving(shard.rank)
            pending[shard.send(engine)] = (shard, engine, time.monotonic())

        for shard in shards:
            send(shard)
        while pending:
            # Not elastic: no bound of its own (the driver's rollout.call_timeout_s is it).
            wait = (max(0.0, min(sent for *_, sent in pending.values()) + self.timeout_s
                        - time.monotonic()) if self.elastic else None)
            done, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if not done:  # the oldest call is past its bound: its engine hangs
                now = time.monotonic()
                for ref, (shard, engine, sent) in list(pending.items()):
                    if now - sent >= self.timeout_s:
                        del pending[ref]
                        why = f"no answer within rollout.generate_timeout_s={self.timeout_s:g} s"
                        self.lose(engine, why, ray.exceptions.GetTimeoutError(
                            f"engine {shard.rank}: {why}"))
                        send(shard)
                continue
            shard, engine, _ = pending.pop(done[0])
            try:
                answer = ray.get(done[0], timeout=self.timeout_s)  # ready: returns at once
            except ENGINE_LOST as err:
                self.lose(engine, f"{type(err).__name__}: {_first_line(err)}", err)
                send(shard)
                continue
            yield shard, answer

    def on_each(self, call: Send) -> list[Any]:
        """``call`` on every live engine (a weight load), answers in rank order; an engine
        that dies meanwhile, or (elastic) does not answer within the generate timeout, is
        lost, not fatal."""
        deadline = time.monotonic() + self.timeout_s
        refs = [(engine, call(engine)) for _, engine in self.live()]
        answers = []
        for engine, ref in refs:
            # Not elastic: no bound of its own (the driver's rollout.call_timeout_s is it).
            wait = max(0.0, deadline - time.monotonic()) if self.elastic else None
            try:
                answers.append(ray.get(ref, timeout=wait))
            except ENGINE_LOST as err:
                self.lose(engine, f"{type(err).__name__} during a weight load: "
                          f"{_first_line(err)}", err)
            except ray.exceptions.GetTimeoutError as err:
                self.lose(engine, f"a weight load past rollout.generate_timeout_s="
                          f"{self.timeout_s:g} s", err)
        return answers

    def replace(self, rank: int, engine: Any, timeout_s: float) -> None:
        """``engine`` serves rank ``rank`` from now on, once it loaded the current weights
        (within ``timeout_s``, its model load included)."""
        ray.get(engine.ping.remote(), timeout=timeout_s)  # constructed: its model loaded
        if self.reload is not None:
            ray.get(self.reload(engine), timeout=timeout_s)
        with self._lock:
            self.engines[rank] = engine
            self._lost.pop(rank, None)

    def take_events(self) -> list[tuple[str, str]]:
        events, self.events = self.events, []
        return events


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""
