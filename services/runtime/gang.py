"""The gang: the one place Ray is started, and where a program's actors are started and
stopped. A job, a session, ``train-rm`` and ``tally eval`` each say which roles they need
(:class:`Roles`) and run with the :class:`Gang` that holds them.

    ensure_ray ─► Gang(config, model_path, roles)
                    reserve_job (one placement group: placement.job_bundles, the one
                    admission rule) ─► teachers · reward actors · engines (loading now)
                    ─► rollout manager (handed its actors; it starts none)
                    ─► policy ranks (load meanwhile) ─► critic ranks
                  ─► run(gang) ─► gang.close(): stops exactly what it started, alive or dead

Every actor started is registered in one ExitStack, so a failure halfway through start-up
stops exactly what was started. :meth:`Gang.actor_records` says where each one runs
(role, rank, pid, node: the job's ``actor_started`` events); :meth:`Gang.replace_engine`
starts a lost engine's replacement in that engine's bundle (rollout/engine_pool.py).
Every start is counted (:func:`count_starts`; with ``TALLY_COUNT_ACTOR_STARTS=<file>``
one line per actor, its role, appended to that file): that is how the suite's actor
starts are counted.

A warm gang: inside :func:`warm_gangs` a gang closed healthy is parked, not stopped, and
the next gang whose ``Roles.reuse_key`` is the same (the same bundles, actor classes and
counts) takes its processes, each made a new actor of the new config in place
(:func:`renew`; trainer ranks by ``RankGroup.rebuild``), sparing the starts and the
imports of torch and transformers (2.5–4 CPU-s an actor). Any other gang first stops the
parked one, so a parked gang holds the cluster only until something else asks for it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from services.runtime import forked_workers
from services.runtime.node_defaults import node_defaults
from services.runtime.quiet import HEAD_ENV, QUIET_ENV

if TYPE_CHECKING:
    from rollout.config import RolloutConfig
    from services.config.job import JobConfig
    from services.runtime.placement import JobPlacement

ACTOR_STARTS_ENV = "TALLY_COUNT_ACTOR_STARTS"
"""A file to which every actor start appends one line (its role): set it to count them."""

actor_starts: Counter[str] = Counter()
"""Actors started by this process, by role."""


def count_starts(role: str, count: int = 1) -> None:
    """Count ``count`` actors of ``role`` started (and log them where ACTOR_STARTS_ENV says)."""
    if count <= 0:
        return
    actor_starts[role] += count
    if path := os.environ.get(ACTOR_STARTS_ENV):
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"{role}\n" * count)


def ensure_ray(num_cpus: int) -> bool:
    """Join the cluster named by RAY_ADDRESS (set by ``ray job submit``, or by a user of
    ``ray start --head``), else start a local head; True if we started it.

    We never guess with ``address="auto"``: a stale local cluster would hang the job. On a
    cluster we do not own, the job's runtime env is left alone; our actors set theirs.
    """
    if ray.is_initialized():
        return False
    os.environ.update({k: v for k, v in QUIET_ENV.items() if k not in os.environ})
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        _stop_quietly_on_sigterm()
        return False
    _drop_token_auth_notice()
    start_local_head(num_cpus, log_to_driver=True, logging_level="WARNING")
    _stop_quietly_on_sigterm()
    return True


_quiet_head: str | None = None
"""The GCS address of the head :func:`start_local_head` last started (its processes
inherit QUIET_ENV)."""


def start_local_head(num_cpus: int, *, fork_workers: bool | None = None,
                     **options: Any) -> None:
    """A Ray head on this machine only (no dashboard) whose every process inherits
    QUIET_ENV: it is in this process's environment while ``ray.init`` spawns the head
    (and so the workers), and put back after. So no actor needs a ``runtime_env``: an
    actor that has one starts through Ray's ``setup_worker``, a second interpreter that
    imports Ray before it execs the worker (0.2–0.25 CPU-s an actor measured by
    benchmarks/actor_start.py), and cannot take a worker the head started ahead. The
    head's own processes also get HEAD_ENV. ``options`` go to ``ray.init``.

    ``fork_workers`` (default: on, unless ``TALLY_FORK_WORKERS=0`` is in the environment)
    has the head fork its workers from a zygote (services/runtime/forked_workers.py); off,
    they are Ray's own fresh interpreters. A head started with ``log_to_driver=False`` has
    no log monitor (:func:`without_log_monitor`)."""
    global _quiet_head
    fork = forked_workers.forking_on() if fork_workers is None else fork_workers
    head_env = {**QUIET_ENV, **HEAD_ENV, **forked_workers.head_env(fork)}
    saved = {name: os.environ.get(name) for name in head_env}
    os.environ.update(head_env)
    try:
        with contextlib.ExitStack() as head_params:
            if fork:
                head_params.enter_context(forked_workers.forked_worker_path())
            if options.get("log_to_driver") is False:
                head_params.enter_context(without_log_monitor())
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **options)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    _quiet_head = ray.get_runtime_context().gcs_address


def without_log_monitor() -> contextlib.AbstractContextManager[None]:
    """While a head starts in this process (``ray.init``): it starts no log monitor. The
    monitor only sends workers' log lines to drivers that take them (``log_to_driver``);
    beside a driver that does not, it read every log file of a long-lived head for
    nothing (49 CPU-s over one 30-minute run of the suite, on one shared test head).
    ``ray.init`` has no option for it (services/runtime/node_defaults.py)."""
    return node_defaults(include_log_monitor=False)


def actor_env() -> dict[str, str]:
    """The ``env_vars`` an actor's ``runtime_env`` must add: none on a head of
    :func:`start_local_head` (its workers have QUIET_ENV), QUIET_ENV on any other (a
    cluster we joined: its workers have whatever its ``ray start`` had)."""
    if ray.is_initialized() and ray.get_runtime_context().gcs_address == _quiet_head:
        return {}
    return dict(QUIET_ENV)


def actor_options() -> dict[str, Any]:
    """``.options(...)`` that give an actor :func:`actor_env` (none where it is empty)."""
    env = actor_env()
    return {"runtime_env": {"env_vars": env}} if env else {}


def _stop_quietly_on_sigterm() -> None:
    """A cancelled job (the controller's stop, ``ray job stop``) ends with one line, not
    the ``*** SIGTERM received … PC: @ 0x7f…`` stack dump of the handler ``ray.init``
    installs (so this one goes in after it); the exit still unwinds, so the ``finally``
    blocks stop what the job started. Only the main thread may set a handler."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stopped(signum: int, _frame: object) -> None:
        print("stopped: SIGTERM (the job was cancelled or its Ray job stopped)", flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)


TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"
"""How Ray (2.60 here) starts the WARNING it logs whenever ``ray.init`` starts a cluster with
``RAY_AUTH_MODE`` unset."""


class _TokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TOKEN_AUTH_NOTICE)


def _drop_token_auth_notice() -> None:
    """Drop Ray's "Token authentication is enabled for this Ray cluster" notice, printed
    on every run. Only the notice goes: the head still gets token auth exactly as Ray sets
    it up (RAY_AUTH_MODE=token for it and its children, ~/.ray/auth_token created if
    missing), and an explicit RAY_AUTH_MODE is left alone (then Ray says nothing anyway);
    its warning that auth is *disabled* still shows. Setting RAY_AUTH_MODE=token ourselves
    would silence it too, but Ray has read the mode into its cached config at import: this
    process stays "disabled" and makes no token, while the GCS it starts inherits "token"
    and never comes up (tried on Ray 2.60)."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _TokenAuthNotice) for f in logger.filters):
        logger.addFilter(_TokenAuthNotice())


@contextlib.contextmanager
def ray_started(num_cpus: int) -> Iterator[bool]:
    """Ray for the block (:func:`ensure_ray`), shut down after if this process started
    it; yields whether it did."""
    started = ensure_ray(num_cpus)
    try:
        yield started
    finally:
        if started:
            ray.shutdown()


def _kill_all(actors: list[Any]) -> None:
    for actor in actors:
        ray.kill(actor)


@dataclass
class RolloutActors:
    """The actors a rollout manager is handed: engines, teachers, reward actors."""

    engines: list[Any] = field(default_factory=list)
    teachers: list[Any] = field(default_factory=list)
    reward_actors: dict[str, list[Any]] = field(default_factory=dict)

    def all(self) -> list[Any]:
        return [*self.engines, *self.teachers,
                *(actor for actors in self.reward_actors.values() for actor in actors)]

    def stop(self) -> None:
        """Kill every one of them (dead or alive: a kill of a dead actor is a no-op)."""
        _kill_all(self.all())


def _resolve(model: str) -> str:
    from rollout.tiny import resolve_model_path
    from services.driver.run_dir import data_dir

    return resolve_model_path(model, data_dir() / "models")


def start_engines(config: RolloutConfig, model_path: str,
                  options: list[dict[str, Any]] | None = None) -> list[Any]:
    """``config.engine``'s engine actors (rollout/manager.start_engines), counted."""
    from rollout.manager import start_engines as start

    engines = start(config, model_path, options or None)
    count_starts("engine", len(engines))
    return engines


def start_engine(config: RolloutConfig, model_path: str, rank: int,
                 options: dict[str, Any] | None = None) -> Any:
    """Engine ``rank`` alone (a lost one's replacement), counted."""
    from rollout.manager import start_engine as start

    engine = start(config, model_path, rank, options)
    count_starts("engine")
    return engine


def start_teachers(config: RolloutConfig, options: list[dict[str, Any]] | None = None
                   ) -> list[Any]:
    """The distillation teachers of ``config`` (rollout/teacher.py), counted; [] without one."""
    from rollout.manager import start_teachers as start

    if config.distillation is None:
        return []
    teachers = start(config.distillation, _resolve(config.distillation.model), options or None)
    count_starts("teacher", len(teachers))
    return teachers


def start_reward_actors(config: RolloutConfig, options: list[dict[str, Any]] | None = None
                        ) -> dict[str, list[Any]]:
    """The reward models' and judges' actors by part name, counted; {} with rules only."""
    from rollout.reward_parts import start_reward_actors as start

    actors = start(config.reward_parts, _resolve, options)
    for name, group in actors.items():
        count_starts(f"reward:{name}", len(group))
    return actors


def start_rollout_actors(config: RolloutConfig, model_path: str, *, engines: bool = True,
                         teachers: bool = True, rewards: bool = True) -> RolloutActors:
    """The rollout actors of ``config``, where Ray puts them (no placement group): for a
    program or test that places no gang but hands a rollout manager its actors. They start
    together and load meanwhile; ``RolloutActors.stop`` (or the manager's ``shutdown``, with
    ``owns_engines``) stops them. On a failure halfway, those started are killed."""
    actors = RolloutActors()
    try:
        actors.teachers = start_teachers(config) if teachers else []
        actors.reward_actors = start_reward_actors(config) if rewards else {}
        actors.engines = start_engines(config, model_path) if engines else []
    except BaseException:
        actors.stop()
        raise
    return actors


GroupFactory = Callable[["JobPlacement | None"], Any]
"""Builds a rank group (``trainer.group``'s kind: ``.workers``, ``.shutdown()``) in the
gang's placement (its ``.group``, and the critic's ``critic_first_bundle``; None: Ray
places its ranks)."""

GroupRenewal = Callable[[Any], None]
"""Rebuilds a parked gang's rank group in place as the group the factory would build
(``RankGroup.rebuild``: the same processes, every rank's state new)."""


@dataclass(frozen=True)
class ActorRecord:
    """Where one actor of the gang runs: what the job's ``actor_started`` event says."""

    role: str
    """engine, teacher, reward:<part>, manager, policy, critic."""
    rank: int
    pid: int
    node: str
    """Its Ray node id."""


def _whereabouts(_actor: object) -> tuple[int, str]:
    """Run inside any actor by ``__ray_call__``: its pid and Ray node (no verb per class)."""
    return os.getpid(), ray.get_runtime_context().get_node_id()


@dataclass(frozen=True)
class EngineSwap:
    """A lost engine's replacement, started and constructed."""

    rank: int
    engine: Any
    old: ActorRecord | None
    """The lost engine's record (None: never recorded)."""
    new: ActorRecord


@dataclass(frozen=True)
class Roles:
    """What a program asks its gang for."""

    policy: GroupFactory | None = None
    """The trained group (policy ranks; the reward model's under train-rm); None: none."""
    critic: GroupFactory | None = None
    """The critic's ranks (PPO), built after the policy's in the critic's bundles."""
    engines: bool = False
    engines_on_ranks: bool = False
    """The colocated fast path: the policy's ranks become the engines (its group's
    ``start_engines``), so no engine actor starts."""
    teachers: bool = False
    reward_actors: bool = False
    manager: bool = False
    """The rollout manager, handed the gang's engines, teachers and reward actors."""
    place: bool = True
    """Reserve the job's bundles (placement.reserve_job) and start each actor in its own;
    False (a program with no trainer ranks, or no JobConfig): Ray places each actor."""
    reuse_key: str | None = None
    """What fixes the gang's processes and where they run (its bundles, the classes and
    counts of its actors): inside :func:`warm_gangs` the next gang of the same key reuses
    this one's. None (the default): the gang is never parked."""
    renew_policy: GroupRenewal | None = None
    renew_critic: GroupRenewal | None = None
    """How ``policy`` and ``critic`` are rebuilt in a reused gang (needed with a key)."""


def renew(actor: object, *args: Any, **kwargs: Any) -> None:
    """Run inside an actor by ``__ray_call__``: forget everything it built (every
    attribute) and construct it anew with these arguments, as a new actor of its class
    would be, sparing the process start and its imports (a reused gang's engines and
    manager). A call queued before it (a rollout asked ahead) runs first."""
    for name in list(vars(actor)):
        delattr(actor, name)
    gc.collect()  # the last model, before the next is loaded
    type(actor).__init__(actor, *args, **kwargs)


_parked: list[Gang] | None = None
"""Inside :func:`warm_gangs`: the gang parked there (at most one); None: outside, every
gang stops when closed."""


@contextlib.contextmanager
def warm_gangs() -> Iterator[None]:
    """Within the block a gang closed healthy (``close(healthy=True)``: no actor failed)
    whose roles have a ``reuse_key`` is parked, and the next gang of that key reuses its
    processes; the parked gang is stopped when another gang starts or the block ends. A
    block inside another is the outer one. For a program that runs jobs one after
    another in one process (a test module): a parked gang holds its bundles."""
    global _parked
    if _parked is not None:
        yield
        return
    _parked = []
    try:
        yield
    finally:
        stop_parked()
        _parked = None


def stop_parked() -> None:
    """Stop the gang parked inside :func:`warm_gangs`, if any (the block goes on): for a
    caller about to ask the cluster for what the parked gang holds, or to leave it. With
    Ray shut down there is nothing left to stop (this driver's actors went with it)."""
    while _parked:
        gang = _parked.pop()
        if ray.is_initialized():
            gang.close()


def _unpark(key: str | None) -> Gang | None:
    """The parked gang of ``key``, taken; any other is stopped (its bundles freed for the
    gang about to start)."""
    if not _parked:
        return None
    gang = _parked.pop()
    if key is not None and gang.roles.reuse_key == key:
        return gang
    gang.close()
    return None


class Gang:
    """The running actors of one program: started once, stopped together by :meth:`close`."""

    def __init__(self, config: JobConfig | None, model_path: str, roles: Roles,
                 on_wait: Callable[[str], None] = print) -> None:
        """``config``: the job's (threads resolved); None only for a program that places
        nothing and starts only its ``policy`` group (train-rm). ``on_wait``: told while
        the placement group waits for resources."""
        self.config, self.model_path, self.roles = config, model_path, roles
        self.placement: JobPlacement | None = None
        self.rollout = RolloutActors()
        self.manager: Any = None
        self.trainer: Any = None
        self.critic: Any = None
        self.records: dict[tuple[str, int], ActorRecord] = {}
        """The last :meth:`actor_records` answer (and replacements since), by role and rank."""
        self.reused = False
        """Whether this gang's actors are a parked gang's, renewed (:func:`warm_gangs`)."""
        parked = _unpark(roles.reuse_key)
        if parked is not None and self._adopt(parked):
            return
        with contextlib.ExitStack() as started:
            self._place(started, on_wait)
            self._start_rollout(started)
            if roles.policy is not None:
                self.trainer = self._start_group("policy", roles.policy, started)
            if roles.critic is not None:
                self.critic = self._start_group("critic", roles.critic, started)
            if roles.engines_on_ranks:
                self._start_on_ranks(started)
            self._started = started.pop_all()

    @property
    def engines(self) -> list[Any]:
        return self.rollout.engines

    @property
    def teachers(self) -> list[Any]:
        return self.rollout.teachers

    @property
    def reward_actors(self) -> dict[str, list[Any]]:
        return self.rollout.reward_actors

    def _place(self, started: contextlib.ExitStack, on_wait: Callable[[str], None]) -> None:
        from ray.util.placement_group import remove_placement_group

        from services.runtime.placement import reserve_job

        if not self.roles.place:
            return
        assert self.config is not None, "placing a gang needs its job config"
        self.placement = reserve_job(self.config, on_wait=on_wait)
        started.callback(remove_placement_group, self.placement.group)

    def _options(self, name: str) -> list[dict[str, Any]] | None:
        return getattr(self.placement, name) if self.placement is not None else None

    def _start_rollout(self, started: contextlib.ExitStack) -> None:
        """Teachers, reward actors and (not colocated) engines, then the manager: they
        load beside the ranks that start after."""
        roles, rollout = self.roles, self.rollout
        if not (roles.teachers or roles.reward_actors or roles.engines or roles.manager):
            return
        assert self.config is not None, "rollout actors need the job config"
        config = self.config.rollout
        if roles.teachers:
            rollout.teachers = start_teachers(config, self._options("teacher_options"))
            started.callback(_kill_all, rollout.teachers)
        if roles.reward_actors:
            rollout.reward_actors = start_reward_actors(config,
                                                        self._options("reward_options"))
            started.callback(rollout.stop)  # teachers and engines again: a kill is idempotent
        if roles.engines and not roles.engines_on_ranks:
            rollout.engines = start_engines(config, self.model_path,
                                            self._options("engine_options"))
            started.callback(_kill_all, rollout.engines)  # the manager's shutdown first
        if roles.manager and not roles.engines_on_ranks:
            self.manager = self._start_manager(owns_engines=True)
            started.callback(self._stop_manager)

    def _start_manager(self, owns_engines: bool) -> Any:
        from rollout.manager import RolloutManagerActor

        options = self.placement.manager_options() if self.placement is not None else {}
        manager = RolloutManagerActor.options(**actor_options(), **options)
        count_starts("manager")
        args, kwargs = self._manager_args(owns_engines)
        return manager.remote(*args, **kwargs)

    def _manager_args(self, owns_engines: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The rollout manager's constructor arguments: handed the gang's actors."""
        assert self.config is not None
        return (self.config.rollout, self.model_path), dict(
            engines=self.engines, owns_engines=owns_engines, teachers=self.teachers,
            reward_actors=self.reward_actors,
            samples_per_step=self.config.logging.samples_per_step,
            estimator_in_driver=self.config.trainer.loss.kl_placement == "reward")

    def _adopt(self, parked: Gang) -> bool:
        """Take ``parked``'s actors (its key is ours: the same bundles, classes and counts)
        and make each a new actor of this config in place: engines and manager by
        :func:`renew`, rank groups by the roles' renewals; the manager's renewal pings
        the renewed engines. False (the parked gang stopped) when any of it fails or
        takes longer than rollout.call_timeout_s: a fresh start says why, as it would
        have."""
        from rollout.manager import engine_args

        roles = self.roles
        assert not roles.engines_on_ranks, "a colocated gang has no reuse key"
        self.placement, self.rollout = parked.placement, parked.rollout
        try:
            renewing = []
            if self.engines:
                assert self.config is not None
                renewing += [engine.__ray_call__.remote(
                    renew, *engine_args(self.config.rollout, self.model_path, rank))
                    for rank, engine in enumerate(self.engines)]
            if parked.manager is not None:
                args, kwargs = self._manager_args(owns_engines=True)
                renewing.append(parked.manager.__ray_call__.remote(renew, *args, **kwargs))
            for group, renewal in ((parked.trainer, roles.renew_policy),
                                   (parked.critic, roles.renew_critic)):
                if group is not None:
                    assert renewal is not None, "a reused gang's group needs its renewal"
                    renewal(group)
            ray.get(renewing, timeout=self._timeout())
        except BaseException as err:
            parked.close()
            if not isinstance(err, Exception):  # an interrupt: nothing is left running
                raise
            self.placement, self.rollout = None, RolloutActors()
            return False  # whatever it was, a fresh start says it in its own words
        self.manager, self.trainer, self.critic = parked.manager, parked.trainer, parked.critic
        self._started, parked._started = parked._started, contextlib.ExitStack()
        self.reused = True
        return True

    def _start_group(self, role: str, build: GroupFactory, started: contextlib.ExitStack
                     ) -> Any:
        group = build(self.placement)
        started.callback(group.shutdown)
        count_starts(role, len(group.workers))
        return group

    def _start_on_ranks(self, started: contextlib.ExitStack) -> None:
        """The colocated fast path: ranks 0 … E−1 serve as the engines, then the manager."""
        assert self.config is not None and self.trainer is not None
        config = self.config.rollout
        self.rollout.engines = self.trainer.start_engines(
            config.engine, config.tokenizer, config.engine.num_engines,
            not config.async_steps)
        if self.roles.manager:
            self.manager = self._start_manager(owns_engines=False)
            # Killed, not asked: its engines are the ranks, and a call would queue behind
            # a rollout waiting on a rank that may be stuck.
            started.callback(ray.kill, self.manager)

    def rollout_call(self, ref: ray.ObjectRef, verb: str) -> Any:
        """The rollout manager's answer; past rollout.call_timeout_s a TimeoutError, which
        restarts the job from its last checkpoint like a stuck trainer call."""
        assert self.config is not None
        timeout = self.config.rollout.call_timeout_s
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"rollout {verb} took longer than rollout.call_timeout_s="
                               f"{timeout:g} s") from None

    def _timeout(self) -> float:
        return self.config.rollout.call_timeout_s if self.config is not None else 600.0

    def _roster(self) -> list[tuple[str, int, Any]]:
        """(role, rank, actor) of every actor the gang started and still holds."""
        roster: list[tuple[str, int, Any]] = []
        if not self.roles.engines_on_ranks:  # else the engines are the policy's ranks
            roster += [("engine", rank, e) for rank, e in enumerate(self.engines)]
        roster += [("teacher", rank, t) for rank, t in enumerate(self.teachers)]
        roster += [(f"reward:{name}", rank, actor)
                   for name, actors in self.reward_actors.items()
                   for rank, actor in enumerate(actors)]
        if self.manager is not None:
            roster.append(("manager", 0, self.manager))
        for role, group in (("policy", self.trainer), ("critic", self.critic)):
            if group is not None:
                roster += [(role, rank, w) for rank, w in enumerate(group.workers)]
        return roster

    def _locate(self, roster: list[tuple[str, int, Any]]) -> list[ActorRecord]:
        """Where each actor of ``roster`` runs, asked of all at once (each answers once
        it is constructed), within rollout.call_timeout_s; recorded."""
        try:
            answers = ray.get([actor.__ray_call__.remote(_whereabouts)
                               for *_, actor in roster], timeout=self._timeout())
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the gang's actors did not say where they run within "
                               f"rollout.call_timeout_s={self._timeout():g} s") from None
        records = [ActorRecord(role, rank, pid, node)
                   for (role, rank, _), (pid, node) in zip(roster, answers, strict=True)]
        self.records.update({(r.role, r.rank): r for r in records})
        return records

    def actor_records(self) -> list[ActorRecord]:
        """Role, rank, pid and node of every actor the gang started (one batched call,
        after start-up): the job writes them as ``actor_started`` events."""
        return self._locate(self._roster())

    def replace_engine(self, rank: int, actor_id: str) -> EngineSwap | None:
        """A new engine ``rank`` in the lost one's bundle, constructed (its model loaded;
        the rollout manager loads the current weights into it: ``replace_engine``), if
        the engine of that rank is still the lost one ``actor_id`` (None: replaced
        already, a second report of the same loss starts nothing)."""
        assert self.config is not None
        old = self.rollout.engines[rank]
        if old._actor_id.hex() != actor_id:
            return None
        ray.kill(old)  # dead already, or killed by the manager: a kill is idempotent
        options = self._options("engine_options")
        engine = start_engine(self.config.rollout, self.model_path, rank,
                              options[rank] if options else None)
        # In place: close() kills the list it was given at start, now with this one in it.
        self.rollout.engines[rank] = engine
        previous = self.records.get(("engine", rank))
        (record,) = self._locate([("engine", rank, engine)])
        return EngineSwap(rank, engine, previous, record)

    def describe_placement(self) -> str:
        """Where each actor landed, for the job's log and events."""
        engine_nodes = self.rollout_call(self.manager.engine_nodes.remote(), "engine_nodes")
        return (f"trainer ranks on nodes {[n[:8] for n in self.trainer.worker_nodes()]}; "
                f"rollout engines on nodes {[n[:8] for n in engine_nodes]}")

    def _stop_manager(self) -> None:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.manager.shutdown.remote(), timeout=60)
        ray.kill(self.manager)

    def close(self, healthy: bool = False) -> None:
        """Stop every actor of the gang, dead or alive, without waiting on a stuck one
        (ranks first: a rank stuck in a collective is killed, not asked), then free its
        bundles. ``healthy`` (no actor failed or timed out): inside :func:`warm_gangs` a
        gang with a ``reuse_key`` and no teacher or reward actor (renewals do not redo
        those) is parked instead. A second call does nothing."""
        if _parked is not None and self in _parked:
            if healthy:
                return
            _parked.remove(self)
        elif (healthy and _parked is not None and self.roles.reuse_key is not None
                and not self.teachers and not self.reward_actors):
            stop_parked()  # one parked at a time: the older stops
            _parked.append(self)
            return
        self._started.close()

    def __enter__(self) -> Gang:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
