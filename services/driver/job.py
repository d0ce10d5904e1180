"""What is job-specific about a job's gang (services/runtime/gang.py): its model folders,
the threads of each phase, and the roles it asks for.

    job_model_path ─► with_threads ─► job_roles ─► Gang(config, model_path, roles)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator

import torch

from rollout.config import SyntheticDatasetConfig
from rollout.engines import engine_actor_options
from rollout.tiny import resolve_model_path
from services.config.job import JobConfig
from services.driver.colocated import ColocatedTrainerGroup
from services.driver.run_dir import data_dir
from services.runtime.gang import Roles, actor_env
from services.runtime.placement import JobPlacement, job_bundles, phase_threads
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


def job_roles(config: JobConfig, model_path: str) -> Roles:
    """An RL job's gang: the policy's ranks (on the colocated fast path also its engines),
    the engines, teachers and reward actors, the rollout manager, and PPO's critic."""
    colocated = config.weight_transport() == "in_process"
    group = ColocatedTrainerGroup if colocated else TrainerGroup

    def policy(placement: JobPlacement | None) -> TrainerGroup:
        assert placement is not None  # a job's gang is placed
        return group(config.trainer, config.objective_config(), model_path,
                     config.policy_schedule_steps, env_vars=actor_env(), placement=placement.group)

    def critic(placement: JobPlacement | None) -> CriticGroup:
        """PPO's critic (trainer/backends/fsdp/critic.py): its ranks in their bundles after
        the reward actors'; its model ``critic.model`` or the policy's."""
        assert placement is not None
        return CriticGroup(config.critic_trainer_config(), config.critic_objective_config(),
                           critic_model_path(config, model_path), config.num_optimizer_steps,
                           config.critic.value_clip, env_vars=actor_env(),
                           placement=placement.group,
                           first_bundle=placement.critic_first_bundle)

    def renew_policy(group: TrainerGroup) -> None:
        group.rebuild(config.trainer, config.objective_config(), model_path,
                      config.policy_schedule_steps)

    def renew_critic(group: CriticGroup) -> None:
        group.rebuild(config.critic_trainer_config(), config.critic_objective_config(),
                      critic_model_path(config, model_path), config.num_optimizer_steps)

    return Roles(policy=policy, critic=critic if config.critic.enabled else None,
                 engines=True, engines_on_ranks=colocated,
                 teachers=config.rollout.distillation is not None, reward_actors=True,
                 manager=True, reuse_key=reuse_key(config), renew_policy=renew_policy,
                 renew_critic=renew_critic)


def reuse_key(config: JobConfig) -> str | None:
    """What fixes a job gang's processes and where they run: its bundles, how many of
    them each role has (equal bundles of two roles would not tell), its engines' Ray
    options and the critic's rank argument (``value_clip``); a later job of the same
    key may reuse them (services/runtime/gang.py ``warm_gangs``). None where a process
    keeps what a renewal does not redo: a transport other than the object store (a
    process group or shared buffers between ranks and engines, the colocated path's
    engines on the ranks), Megatron's module globals, a teacher, an SGLang server."""
    critic = config.critic_trainer_config() if config.critic.enabled else None
    if (config.weight_transport() != "object_store" or config.rollout.engine.type != "torch"
            or config.trainer.backend != "fsdp" or config.rollout.distillation is not None
            or (critic is not None and critic.backend != "fsdp")):
        return None
    return json.dumps({"bundles": job_bundles(config),
                       "cross_node": config.trainer.allow_cross_node,
                       "ranks": config.trainer.world_size,
                       "engines": config.rollout.engine.num_engines,
                       "engine": engine_actor_options(config.rollout.engine),
                       "critic_ranks": critic.world_size if critic else 0,
                       "value_clip": config.critic.value_clip if critic else None},
                      sort_keys=True)
