"""The driver loop of one RL job on Ray: ``run_job`` restarts, ``rollout_step`` is one
rollout step top to bottom.

    configs/*.yaml ──► JobConfig (validated before any actor starts)
                          │
       RolloutManager ────┼──► engines ──► rewards ──► advantages ──► RolloutBatch
       (pipeline.py:      │                                          (object store)
        k steps ahead)    ▼                                               │
            ▲      TrainerGroup: DP × CP rank actors ◄── optimizer steps ─┘
            │             │   (mini-batches of whole groups, Σ w·ℓ, grad SUM)
            └── weights ──┘   weight_sync.py: start(v) / wait()
                          ▼
      sinks.py: metrics.jsonl · TensorBoard · W&B · controller   checkpoint.py: step_N

The driver owns the order; the rollout manager and the trainer group expose a few verbs.
Vocabulary (docs/glossary.md): a *rollout step* generates one RolloutBatch and trains it
in ``num_updates_per_rollout`` *optimizer steps*; ``num_steps`` counts rollout steps,
numbered 0 … num_steps − 1 in every row, event file, checkpoint name and progress line.

A lost rollout engine costs no restart: its shard is re-run on a live engine with its
seed (rollout/engine_pool.py), and each step the driver has the gang start a replacement
in its bundle, which the manager loads with the current weights
(:func:`replace_lost_engines`). Any other fault (a trainer rank or the manager killed, a
node lost, a call past its timeout) restarts the actors from the last checkpoint, at most
``max_restarts`` times; an exception an actor raises (in its
constructor, its setup or a verb: a dataset or model that does not load) fails the job
at once, since a restart would raise it again.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray

from rollout.advantages import AdvantageEstimator, build_estimator
from rollout.batch import RolloutBatch
from rollout.remote import RemoteOutage
from services.config.job import JobConfig
from services.driver import checkpoint
from services.driver.advantages import KLInReward, driver_advantages
from services.driver.critic_warmup import EXPLAINED_VARIANCE, WAITING, CriticWarmup
from services.driver.evaluation import Evaluation
from services.driver.job import driver_threads, job_model_path, job_roles, with_threads
from services.driver.metrics import (
    LearningSignalWatch,
    Progress,
    critic_metrics,
    rollout_metrics,
    skipped_rollout_metrics,
)
from services.driver.pipeline import RolloutPipeline
from services.driver.retention import best_eval_step, retire_checkpoints
from services.driver.run_dir import ANSI, EVAL_FILE, UPDATES_FILE, RunDir, job_dir, replace_file
from services.driver.sample_tokens import logged_samples
from services.driver.samples import append_samples
from services.driver.sinks import JsonlSink, MetricsSink, TensorBoardSink, read_metrics
from services.driver.wandb_sink import wandb_sinks
from services.driver.weight_sync import WeightSync, transport_for
from services.runtime.gang import ActorRecord, Gang, ensure_ray, stop_parked
from services.runtime.placement import PlacementFailed, local_head_cpus, refuse_if_never_fits
from services.runtime.preflight import preflight
from services.runtime.quiet import quiet_transformers
from trainer import checkpoint as trainer_checkpoint
from trainer.group import TrainerRankDied
from trainer.mini_batches import mini_batch, rollout_updates


class JobFailed(RuntimeError):
    """The job stopped for good: an actor raised an exception, or died and the restarts
    are used up. Its text is one line that says why."""


@dataclass
class RunningJob:
    """One start of the job's actors and the parts its loop drives."""

    config: JobConfig
    run_dir: RunDir
    actors: Gang
    pipeline: RolloutPipeline
    weights: WeightSync
    evaluation: Evaluation
    updates: JsonlSink
    """updates.jsonl: one row per optimizer step."""
    estimator: AdvantageEstimator
    """rollout.advantage's: the manager calls it, unless it needs the critic's values."""
    kl: KLInReward | None = None
    """The KL in the reward (trainer.loss.kl_placement: reward) and its β, checkpointed."""
    warmup: CriticWarmup = field(default_factory=CriticWarmup)
    """When the policy starts to train beside the critic (services/driver/critic_warmup.py)."""
    checkpointed: dict[str, float] = field(default_factory=dict)
    """The last checkpoint's time and peak memory, for the next row (a checkpoint is
    written after its step's row)."""

    @classmethod
    def start(cls, config: JobConfig, run_dir: RunDir, model_path: str,
              log: Callable[[str], None] = print) -> RunningJob:
        actors = Gang(config, model_path, job_roles(config, model_path),
                      on_wait=lambda message: (log(message),
                                               run_dir.write_event("waiting", message)))
        try:
            return cls._around(config, run_dir, actors)
        except BaseException:  # e.g. a transport that cannot be built: nothing left running
            actors.close()
            raise

    @classmethod
    def _around(cls, config: JobConfig, run_dir: RunDir, actors: Gang) -> RunningJob:
        """The job's parts around its started gang."""
        manager, call = actors.manager, actors.rollout_call
        evals = JsonlSink(run_dir.path, EVAL_FILE)
        return cls(
            config, run_dir, actors,
            RolloutPipeline(manager.generate_batch.remote,
                            lambda ref: call(ref, "generate_batch"),
                            config.rollout.async_steps, config.num_steps),
            WeightSync(transport_for(config.weight_transport(), actors.trainer, manager,
                                     config.engine_dtype(),
                                     config.trainer.weight_sync.bucket_mb, call), call),
            Evaluation(config.eval, config.num_steps, lambda version: manager.evaluate.remote(
                config.eval_dataset(), config.eval.num_prompts, config.eval.num_samples,
                config.eval.temperature or config.rollout.sampling.temperature, version),
                lambda ref: call(ref, "evaluate"),
                lambda ref: bool(ray.wait([ref], timeout=0)[0]), evals.write,
                lambda samples: append_samples(run_dir.samples_file, samples,
                                               config.logging.samples_max_mb)),
            JsonlSink(run_dir.path, UPDATES_FILE), build_estimator(config.rollout.advantage),
            KLInReward.of(config.trainer.loss),
            CriticWarmup(config.critic.warmup_steps,
                         config.critic.warmup_until_explained_variance))

    def close(self, healthy: bool = False) -> None:
        """``healthy``: no actor failed (its gang may be parked: gang.warm_gangs)."""
        self.updates.close()
        self.actors.close(healthy)


def rollout_step(job: RunningJob, step: int, lookahead: int | None = None
                 ) -> dict[str, float]:
    """Evaluate (when due) → generate → train each optimizer step → sync weights → the
    row. ``lookahead`` overrides rollout.async_steps for this call (0: wait for the
    newest weights); with k > 0 evaluations are collected when done, never waited for
    behind the rollouts in flight, except where the row must hold them (a checkpoint,
    the last step)."""
    config, last = job.config, step == job.config.num_steps - 1
    wait_for_eval = last or not config.rollout.async_steps or checkpoint.due(step, config)
    started = time.perf_counter()
    job.evaluation.start(version=step)  # queued after the load of weights `step`
    evaluated = job.evaluation.collect(wait=not config.rollout.async_steps)
    batch, batch_ref = job.pipeline.take(step, lookahead)
    replaced = replace_lost_engines(job)  # one lost while this rollout or a later one ran
    # PPO: the critic's values, then GAE; the KL in the reward: β·k1, then the estimator
    if (scored := driver_advantages(batch, job.estimator, job.kl, job.actors.trainer,
                                    job.actors.critic, config.num_updates_per_rollout > 1)
            ) is not None:
        batch, batch_ref = scored, None
    for kind, message in batch.events:  # e.g. an environment that failed in an episode
        job.run_dir.write_event(kind, message)
    append_samples(job.run_dir.samples_file,  # before training: the weights it trains from
                   logged_samples(batch, job.actors.trainer, config.logging.sample_tokens),
                   config.logging.samples_max_mb)
    job.weights.poll()
    generated = time.perf_counter()
    if batch.num_valid_tokens == 0:  # nothing to learn from: skipped, never NaN
        metrics = skipped_rollout_metrics(batch)
    else:
        train_window = time.time()
        per_update = train_optimizer_steps(job, step, batch, batch_ref)
        job.pipeline.trained(step, (train_window, time.time()))
        trained = time.perf_counter()
        synced = job.weights.start(version=step + 1)  # the engines load meanwhile
        times = {"rollout": generated - started, "train": trained - generated,
                 "sync": time.perf_counter() - trained}
        metrics = {**rollout_metrics(batch, per_update, times,
                                     job.actors.trainer.objective.mode_metric_divisor),
                   **job.pipeline.metrics(batch, step), **synced, **job.checkpointed}
        job.checkpointed = {}
    if last:  # the final trained weights are evaluated too, in the last row
        job.weights.wait()
        job.evaluation.start(version=step + 1)
    return {**metrics, **evaluated, **job.evaluation.collect(wait=wait_for_eval),
            "rollout/engines_replaced": float(replaced)}


def replace_lost_engines(job: RunningJob) -> int:
    """Each engine the manager lost and still misses, replaced: the gang starts a new one
    in its bundle, the manager loads the current weights into it (queued behind the
    rollouts in flight; that load is waited for like a weight sync's); events
    ``actor_started`` and ``engine_replaced``. Returns how many were replaced."""
    gang = job.actors
    lost = gang.rollout_call(gang.manager.lost_engines.remote(), "lost_engines")
    replaced = 0
    for rank, actor_id in lost:
        swap = gang.replace_engine(rank, actor_id)
        if swap is None:
            continue
        job.weights.follow(gang.manager.replace_engine.remote(rank, swap.engine))
        write_actor_started(job.run_dir, [swap.new])
        old_pid = swap.old.pid if swap.old is not None else None
        job.run_dir.write_event(
            "engine_replaced",
            f"engine {rank} replaced: pid {old_pid} lost, pid {swap.new.pid} started",
            rank=rank, old_pid=old_pid, new_pid=swap.new.pid)
        replaced += 1
    return replaced


def write_actor_started(run_dir: RunDir, records: list[ActorRecord]) -> None:
    for r in records:
        run_dir.write_event("actor_started", f"{r.role} {r.rank}: pid {r.pid} on node "
                            f"{r.node[:8]}", role=r.role, rank=r.rank, pid=r.pid, node=r.node)


def train_optimizer_steps(job: RunningJob, step: int, batch: RolloutBatch,
                          batch_ref: ray.ObjectRef | None) -> list[dict[str, float]]:
    """The rollout's optimizer steps in order (mini-batches of whole groups × epochs),
    each with its own exact J; a mini-batch with no valid token is skipped and reported
    (``skipped`` in updates.jsonl, ``updates/skipped`` in the row), never stepped. The
    critic, when there is one, steps on the same mini-batches at the same time, on its
    own ranks (``critic/*``); during its warm-up it steps alone (critic_warmup.py: the
    policy's optimizer and schedule do not move)."""
    config, trainer, critic = job.config, job.actors.trainer, job.actors.critic
    policy_steps = critic is None or job.warmup.policy_trains(
        step, batch.metadata.get(EXPLAINED_VARIANCE))
    updates = rollout_updates(batch, config.rollout.global_batch_size,
                              config.trainer.ppo_epochs, config.trainer.seed, step)
    if (len(updates) > 1 and config.trainer.loss.old_log_probs == "trainer" and policy_steps
            and batch.old_log_probs is None):  # the KL in the reward may have them
        batch = batch.with_old_log_probs(trainer.log_probs(batch))  # π at the start
        batch_ref = None  # the stored batch has no old log-probs
    per_update = []
    for update in updates:  # fetched once; each mini-batch planned on its own
        mini = mini_batch(batch, update)
        critic_step = (critic.start_train(mini) if critic is not None and mini.num_valid_tokens
                       else None)  # on its own ranks, while the policy's step runs
        metrics = {"skipped": 1.0} if not mini.num_valid_tokens else (
            trainer.train(mini, batch_ref if mini is batch else None) if policy_steps
            else {})
        if critic_step is not None:
            metrics |= critic_metrics(critic_step())
        if critic is not None:
            metrics[WAITING] = float(not policy_steps)
        job.updates.write(step * config.num_updates_per_rollout + update.index,
                          {**metrics, "rollout": float(step), "update": float(update.index),
                           "epoch": float(update.epoch)})
        per_update.append(metrics)
    return per_update


def save_checkpoint(job: RunningJob, step: int) -> Path:
    """Trainer state, then the driver's (rollout cursor, rollouts in flight), staged and
    committed as one folder; checkpoints/latest then points at it."""
    root = job.run_dir.checkpoints_dir
    staging = trainer_checkpoint.staging_path(root, step)
    job.checkpointed = job.actors.trainer.save_checkpoint(str(staging))
    if job.kl is not None:  # β, beside the driver's state
        job.kl.save(staging)
    if job.actors.critic is not None:  # its own shards, committed with the policy's
        job.actors.critic.save_checkpoint(str(staging / trainer_checkpoint.CRITIC_DIR))
    rollout_state = job.actors.rollout_call(job.actors.manager.state_dict.remote(),
                                            "state_dict")
    checkpoint.save_driver_state(staging, checkpoint.DriverState(
        step, rollout_state, job.pipeline.state_dict()))
    committed = trainer_checkpoint.commit_checkpoint(root, step)
    checkpoint.link_latest(job.run_dir)
    retire_checkpoints(root, job.config.checkpoint_keep_last, job.config.num_steps - 1,
                       best_eval_step(job.run_dir.eval_file))
    return committed


def restore(job: RunningJob, latest: Path | None, log: Callable[[str], None]) -> int:
    """Resume from checkpoint ``latest`` (None: from the start); returns the first rollout
    step to run. The rows of the steps from there on go: a stopped run or a failed
    attempt may have written some after its last checkpoint, and each step keeps one row
    (that of the run that goes on)."""
    if latest is None:
        checkpoint.truncate_rows_after(job.run_dir, -1, job.config.num_updates_per_rollout)
        return 0
    state = checkpoint.load_driver_state(latest)
    job.actors.trainer.load_checkpoint(str(latest))
    if job.kl is not None:
        job.kl.load(latest, log)
    if job.actors.critic is not None:
        critic_part = latest / trainer_checkpoint.CRITIC_DIR
        if critic_part.is_dir():
            job.actors.critic.load_checkpoint(str(critic_part))
        else:  # a checkpoint of a run without one (resumed with --force)
            log(f"{latest} holds no critic: the critic starts from its model")
    job.actors.rollout_call(job.actors.manager.load_state_dict.remote(state.rollout),
                            "load_state_dict")
    job.weights.start(version=state.step + 1)
    job.weights.wait()
    job.pipeline.load_state_dict(state.in_flight)
    checkpoint.truncate_rows_after(job.run_dir, state.step, job.config.num_updates_per_rollout)
    job.warmup.restore(row["metrics"] for row in read_metrics(job.run_dir.metrics_file))
    log(f"resumed from {latest} (rollout step {state.step} done)")
    return state.step + 1


def export_final_weights(run_dir: RunDir, log: Callable[[str], None]) -> None:
    """The last checkpoint (the last step always has one) as a Hugging Face folder, and
    under LoRA its adapters as peft's folder too."""
    from trainer.export import ExportError, export_checkpoint

    latest = trainer_checkpoint.latest_checkpoint(run_dir.checkpoints_dir)
    if latest is None:
        return
    if (latest / trainer_checkpoint.ADAPTER_DIR).is_dir():  # the adapters first: they
        adapters = export_checkpoint(latest, run_dir.final_adapter_dir, adapter=True)
        log(f"final adapters: {adapters}")  # need nothing but the checkpoint
        try:
            log(f"final weights: {export_checkpoint(latest, run_dir.final_model_dir)}")
        except ExportError as err:  # e.g. a base model folder without safetensors
            log(f"final weights not merged ({err}); the adapters are in {adapters}")
        return
    log(f"final weights: {export_checkpoint(latest, run_dir.final_model_dir)}")


def finished(config: JobConfig, run_dir: RunDir, plan: checkpoint.ResumePlan,
             log: Callable[[str], None]) -> list[dict[str, float]]:
    """A job whose checkpoint holds every step: say so in one line (its final weights
    exported first if a stop came between the two), start nothing; its rows."""
    assert plan.checkpoint is not None
    job_folder = plan.checkpoint.parent.parent
    if job_folder.resolve() == run_dir.path.resolve() and not run_dir.final_model_dir.is_dir():
        export_final_weights(run_dir, lambda _: None)
    log(f"job {config.name} is finished: all {config.num_steps} rollout steps are done in "
        f"{job_folder} (final weights: {job_folder / run_dir.final_model_dir.name}/); "
        "raise num_steps to train further, or pass --no-resume to start again")
    return [row["metrics"] for row in read_metrics(RunDir(job_folder).metrics_file)]


def run_job(config: JobConfig, output_dir: Path | None = None,
            extra_sinks: list[MetricsSink] | None = None, log: Callable[[str], None] = print,
            after_step: Callable[[int, RunningJob], None] | None = None,
            resume_from: Path | None = None, force: bool = False, preflighted: bool = False
            ) -> list[dict[str, float]]:
    """Run a whole job; returns every step's row. Starts (and stops) Ray if none runs.

    It resumes as :func:`checkpoint.plan_resume` decides (``resume_from``: that
    checkpoint; ``force``: despite settings that break exactness), before anything
    starts: a refused resume is a ConfigError, a finished job starts nothing. When an
    actor dies or a call times out, the actors are started again and the job resumes
    from its last checkpoint, at most ``max_restarts`` times; the rows up to that
    checkpoint are kept, those after it are written again (once). ``preflighted``: the
    caller ran ``preflight`` on this config already (services/train.py, before it imported
    the driver), so the dataset is not read and the modules not imported twice.
    """
    if not preflighted:
        preflight(config, load_user_code=True)  # the job: its user modules import here
    quiet_transformers()
    run_dir = RunDir(output_dir or job_dir(config.name, config.output_dir))
    plan = checkpoint.plan_resume(config, run_dir, resume_from, force, log)
    if plan.finished:
        return finished(config, run_dir, plan, log)
    run_dir.create()
    started_ray = ensure_ray(local_head_cpus(config))  # the head preflight judged
    sinks: list[MetricsSink] = []
    try:
        try:  # before the warm start: a job that can never be placed is told in seconds
            refuse_if_never_fits(config)
        except PlacementFailed as err:
            run_dir.write_event("placement_failed", str(err))
            raise JobFailed(f"job {config.name}: {err}") from err
        model_path = job_model_path(config, log)
        config = with_threads(config, model_path)
        replace_file(run_dir.config_file, config.model_dump_json(indent=2))
        for change in plan.changes:
            log(f"config changed since {plan.checkpoint}: {change}")
            run_dir.write_event("config_changed", change)
        for warning in config.warnings():  # rules that chose, inert options: say so
            log(f"warning: {warning.field}: {warning.message}")
            run_dir.write_event("config_warning", f"{warning.field}: {warning.message}")
        sinks = [JsonlSink(run_dir.path), TensorBoardSink(run_dir.path),
                 *wandb_sinks(config.logging.wandb, run_dir.path, config.name,
                              config.model_dump(mode="json")), *(extra_sinks or [])]
        with driver_threads():  # the warm start above trains with every thread
            history = run_with_restarts(config, run_dir, model_path, sinks, log, after_step,
                                        plan.checkpoint)
        for line in run_dir.describe():
            log(line)
        return history
    finally:
        for sink in sinks:
            sink.close()
        if started_ray:
            stop_parked()  # a gang parked on the head about to go (gang.warm_gangs)
            ray.shutdown()


def run_with_restarts(config: JobConfig, run_dir: RunDir, model_path: str,
                      sinks: list[MetricsSink], log: Callable[[str], None],
                      after_step: Callable[[int, RunningJob], None] | None,
                      resume_from: Path | None) -> list[dict[str, float]]:
    history: dict[int, dict[str, float]] = {}
    restarts, signal = 0, LearningSignalWatch()
    while True:
        job, actors_failed = None, False
        try:
            job = RunningJob.start(config, run_dir, model_path, log)
            run_dir.write_event("placement", job.actors.describe_placement())
            write_actor_started(run_dir, job.actors.actor_records())
            start, progress = restore(job, resume_from, log), Progress(config.num_steps)
            log(f"job {config.name}: rollout steps {start}..{config.num_steps - 1}, "
                f"mode={config.aggregation.mode}, dp={config.trainer.dp_size} "
                f"cp={config.trainer.cp_size}, output {run_dir.path}")
            for step in range(start, config.num_steps):
                row = {**rollout_step(job, step), "job/restarts": float(restarts)}
                for sink in sinks:
                    sink.write(step, row)
                history = {k: v for k, v in history.items() if k < step} | {step: row}
                log(progress.line(step, list(history.values())))
                if job.estimator.uses_rewards and (
                        warning := signal.check(row)):  # a teacher's signal needs no spread
                    log(f"warning: {warning}")
                    run_dir.write_event("no_learning_signal", warning)
                if checkpoint.due(step, config):
                    save_checkpoint(job, step)
                if after_step is not None:
                    after_step(step, job)
            export_final_weights(run_dir, log)
            return list(history.values())
        except PlacementFailed as err:  # a restart would wait or be refused again
            run_dir.write_event("placement_failed", str(err))
            raise JobFailed(f"job {config.name}: {err}") from err
        except (TrainerRankDied, ray.exceptions.RayError, TimeoutError) as err:
            actors_failed = True
            reason, fault = failure(err)
            run_dir.write_event("actor_failed", reason)
            if not fault:
                raise JobFailed(f"job {config.name}: {reason} (not retried: a restart "
                                "would raise it again)") from err
            if restarts >= config.max_restarts:
                raise JobFailed(f"job {config.name}: {reason} (restarts used: "
                                f"{restarts}/{config.max_restarts})") from err
            restarts += 1
            run_dir.write_event("restart", f"restart {restarts}/{config.max_restarts} "
                                "from the last checkpoint")
            log(f"{reason}; restarting ({restarts}/{config.max_restarts}) from the last "
                "checkpoint")
            resume_from = checkpoint.newest_readable(run_dir, log) or resume_from
        finally:
            if job is not None:  # a gang no actor failed in may be reused (gang.warm_gangs)
                job.close(healthy=not actors_failed)


ACTOR = re.compile(r"ray::(\w+)\.(\w+)\(\)")
CALL_TIMED_OUT = "took longer than rollout.call_timeout_s"
FAULT_WORDS = ("The actor died unexpectedly", "ActorUnavailableError", "Worker exit type",
               "NodeDiedError", "OutOfMemoryError", "ObjectLostError", CALL_TIMED_OUT)
"""Said by Ray when a process or node went away: a fault, even inside a constructor."""
ACTOR_NAMES = {"RolloutManager": "the rollout manager"}


def failure(err: BaseException) -> tuple[str, bool]:
    """One line that says why the job's actors failed, and whether it is a fault a
    restart may get past: a process killed, a node lost, a call past its timeout or a
    remote reward endpoint down for a step (RemoteOutage) is, and so is an actor's own call
    past its timeout (a TimeoutError it raises, even in its constructor: the manager's
    start-up ping); any other exception raised by an actor's constructor, setup or verb is
    not (its cause, in Python's words, is the line)."""
    cause = err.__cause__ if isinstance(err, TrainerRankDied) else err
    if isinstance(cause, ray.exceptions.RayTaskError) and not isinstance(
            cause.cause, ray.exceptions.RayError):
        said = "; ".join(str(cause.cause).strip().splitlines())
        # A remote reward endpoint that stayed down is outside the job: a restart may
        # find it back, so it is a fault (rollout/remote.py); any other raise is not.
        return (f"{_actor_of(str(cause))} failed: {type(cause.cause).__name__}: {said}",
                isinstance(cause.cause, RemoteOutage | TimeoutError))
    text = ANSI.sub("", str(cause))
    if isinstance(cause, ray.exceptions.RayActorError) and cause.actor_init_failed:
        fault = any(word in text for word in FAULT_WORDS)
        # Its own start-up call past its timeout (the manager's ping) is a fault said as
        # the timeout, naming the field; a process lost meanwhile is said by Ray's line.
        if not fault or CALL_TIMED_OUT in text:
            who = (f"trainer rank {err.rank}" if isinstance(err, TrainerRankDied)
                   else _actor_of(text))
            return f"{who} failed to start: {_exception_line(text)}", fault
    return ANSI.sub("", str(err)).strip().splitlines()[0], True


def _actor_of(text: str) -> str:
    """``the rollout manager`` (its constructor), ``FSDPWorker.setup``: who raised."""
    found = ACTOR.search(ANSI.sub("", text))
    if found is None:
        return "an actor"
    name, method = found.groups()
    return ACTOR_NAMES.get(name, name) if method == "__init__" else f"{name}.{method}"


def _exception_line(text: str) -> str:
    """The exception of the innermost traceback in Ray's text, on one line."""
    lines = text.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    said = [line.strip() for line in lines[frames[-1] + 1:] if line and not line[0].isspace()
            ] if frames else []
    return " ".join(said or lines[-1:])
