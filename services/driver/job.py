"""The actors of one job, up and down: Ray, the placement group, the rollout manager with
its engines (and teachers), the trainer group, the critic's group (PPO with a critic).

    ensure_ray ─► reserve_job (one placement group: ranks | engines) ─► RolloutManager
                  (starts loading) ─► TrainerGroup (loads meanwhile) ─► … ─► close()

Every actor started is registered in one ExitStack, so a failure halfway through start-up
stops exactly what was started, and ``close`` stops the rest whether alive or dead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import ray
import torch
from ray.util.placement_group import remove_placement_group

from rollout.config import RolloutConfig, SyntheticDatasetConfig
from rollout.manager import RolloutManagerActor, start_engines, start_teachers
from rollout.reward_parts import start_reward_actors
from rollout.tiny import resolve_model_path
from services.config.job import JobConfig
from services.driver.colocated import ColocatedTrainerGroup
from services.driver.run_dir import RunDir, data_dir
from services.runtime.gang import _drop_token_auth_notice, ensure_ray  # noqa: F401  (moved)
from services.runtime.placement import JobPlacement, phase_threads, reserve_job
from services.runtime.quiet import QUIET_ENV
from services.runtime.warmup import warm_start
from trainer.group import CriticGroup, TrainerGroup


def job_model_path(config: JobConfig, log: Callable[[str], None] = print) -> str:
    """The local model folder a job starts from: ``tiny`` built once, a warm start cached."""
    model_path = resolve_model_path(config.rollout.model, data_dir() / "models")
    if config.warmup.enabled:
        assert isinstance(config.rollout.dataset, SyntheticDatasetConfig)
        model_path = warm_start(model_path, config.rollout.dataset, config.warmup,
                                data_dir() / "warmup", log)
    return model_path


def critic_model_path(config: JobConfig, model_path: str) -> str:
    """The critic's start folder: ``critic.model`` resolved like ``rollout.model``, or the
    policy's own ``model_path`` (a fresh value head on its decoder)."""
    if config.critic.model is None:
        return model_path
    return resolve_model_path(config.critic.model, data_dir() / "models")


def with_threads(config: JobConfig, model_path: str) -> JobConfig:
    """The job config with the threads of each phase resolved (services/runtime/placement.py:
    they depend on rollout.async_steps and the model's width); the driver writes this
    resolved config to the job folder, so what ran is what it says."""
    engine_threads, rank_threads = phase_threads(config, model_path)
    engine = config.rollout.engine
    if hasattr(engine, "num_threads"):
        engine = engine.model_copy(update={"num_threads": engine_threads})
    return config.model_copy(update={
        "trainer": config.trainer.model_copy(update={"num_threads": rank_threads}),
        "rollout": config.rollout.model_copy(update={"engine": engine})})


@contextlib.contextmanager
def driver_threads() -> Iterator[None]:
    """The driver's own tensor work (plans, mini-batches, the row's metrics: tensors of a
    few KB) on one intra-op thread, the caller's setting restored after. More threads
    only wake a pool whose threads wait for a core the ranks and engines hold: on the
    2-core CPU demo ``rollout_metrics`` took 8 ms with 2 threads and 0.3 ms with 1,
    ``RolloutBatch.select`` 24 ms and 0.2 ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _kill_all(actors: list[ray.actor.ActorHandle]) -> None:
    for actor in actors:
        ray.kill(actor)


class JobActors:
    """The running actors of one job and the manager's call path."""

    def __init__(self, config: JobConfig, run_dir: RunDir, model_path: str,
                 log: Callable[[str], None] = print) -> None:
        """``config``: resolved by :func:`with_threads`."""
        self.rollout_config: RolloutConfig = config.rollout
        with contextlib.ExitStack() as started:
            gang = reserve_job(config, on_wait=lambda message: (
                log(message), run_dir.write_event("waiting", message)))
            started.callback(remove_placement_group, gang.group)
            manager = RolloutManagerActor.options(runtime_env={"env_vars": QUIET_ENV},
                                                  **gang.manager_options())
            in_process = config.weight_transport() == "in_process"
            teachers = self._start_teachers(config, gang.teacher_options, started)
            rewards = self._start_reward_actors(config, gang.reward_options, started)
            extra = {"reward_actors": rewards,
                     "samples_per_step": config.logging.samples_per_step}
            if not in_process:  # the engines load now, beside the manager and the ranks
                engines = start_engines(config.rollout, model_path, gang.engine_options)
                started.callback(_kill_all, engines)  # the manager's shutdown stops them first
                self.manager = manager.remote(config.rollout, model_path, None, None,
                                              engines, True, teachers, **extra)
                started.callback(self._stop_manager)
            # the colocated fast path: the ranks are the engines, composed here
            group = ColocatedTrainerGroup if in_process else TrainerGroup
            self.trainer = group(config.trainer, config.objective_config(), model_path,
                                 config.num_optimizer_steps, env_vars=QUIET_ENV,
                                 placement=gang.group)
            started.callback(self.trainer.shutdown)
            self.critic = self._start_critic(config, model_path, gang, started)
            if isinstance(self.trainer, ColocatedTrainerGroup):
                engines = self.trainer.start_engines(
                    config.rollout.engine, config.rollout.tokenizer,
                    config.rollout.engine.num_engines, not config.rollout.async_steps)
                self.manager = manager.remote(config.rollout, model_path, None, None, engines,
                                              None, teachers, **extra)
                # Killed, not asked: its engines are the ranks, and a call would queue
                # behind a rollout waiting on a rank that may be stuck.
                started.callback(ray.kill, self.manager)
            self._started = started.pop_all()

    @staticmethod
    def _start_teachers(config: JobConfig, options: list[dict[str, Any]],
                        started: contextlib.ExitStack) -> list[Any] | None:
        """The distillation teachers (rollout/teacher.py), started beside the rest in
        their bundles; None without a teacher."""
        teacher = config.rollout.distillation
        if teacher is None:
            return None
        teachers = start_teachers(teacher, resolve_model_path(
            teacher.model, data_dir() / "models"), options or None)
        started.callback(_kill_all, teachers)
        return teachers

    @staticmethod
    def _start_reward_actors(config: JobConfig, options: list[dict[str, Any]],
                             started: contextlib.ExitStack) -> dict[str, list[Any]]:
        """The reward models' and judges' actors (rollout/reward_parts.py), started
        beside the rest in their bundles; {} with rules only."""
        actors = start_reward_actors(
            config.rollout.reward_parts,
            lambda model: resolve_model_path(model, data_dir() / "models"), options)
        started.callback(_kill_all, [a for group in actors.values() for a in group])
        return actors

    @staticmethod
    def _start_critic(config: JobConfig, model_path: str, gang: JobPlacement,
                      started: contextlib.ExitStack) -> CriticGroup | None:
        """PPO's critic (trainer/backends/fsdp/critic.py): its ranks in their bundles after
        the teachers'; its model ``critic.model`` or the policy's; None without one."""
        if not config.critic.enabled:
            return None
        critic = CriticGroup(config.critic_trainer_config(), config.critic_objective_config(),
                             critic_model_path(config, model_path),
                             config.num_optimizer_steps, config.critic.value_clip,
                             env_vars=QUIET_ENV, placement=gang.group,
                             first_bundle=gang.critic_first_bundle)
        started.callback(critic.shutdown)
        return critic

    def rollout_call(self, ref: ray.ObjectRef, verb: str) -> Any:
        """The rollout manager's answer; past rollout.call_timeout_s a TimeoutError, which
        restarts the job from its last checkpoint like a stuck trainer call."""
        timeout = self.rollout_config.call_timeout_s
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"rollout {verb} took longer than rollout.call_timeout_s="
                               f"{timeout:g} s") from None

    def placement(self) -> str:
        """Where each actor landed, for the job's log and events."""
        engine_nodes = self.rollout_call(self.manager.engine_nodes.remote(), "engine_nodes")
        return (f"trainer ranks on nodes {[n[:8] for n in self.trainer.worker_nodes()]}; "
                f"rollout engines on nodes {[n[:8] for n in engine_nodes]}")

    def _stop_manager(self) -> None:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.manager.shutdown.remote(), timeout=60)
        ray.kill(self.manager)

    def close(self) -> None:
        """Stop every actor of the job, dead or alive, without waiting on a stuck one
        (trainer ranks first: a rank stuck in a collective is killed, not asked)."""
        self._started.close()
