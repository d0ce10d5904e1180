"""The driver: one RL job on Ray. ``python -m services.train configs/demo.yaml``.

    configs/*.yaml ──► JobConfig (validated before any actor starts)
                          │
       RolloutManager ────┼──► engines ──► rewards ──► advantages ──► RolloutBatch
       (Ray actor)        │                                         (object store)
            ▲             ▼                                              │
            │      TrainerGroup: DP × CP rank actors (FSDP2) ◄───────────┘
            │             │   weights from whole-step metadata, Σ w·ℓ, grad SUM
            └── weights ──┘   (object store)
                          ▼
        metrics.jsonl · TensorBoard · controller           checkpoints/step_N

The driver owns the loop; rollout and trainer expose a few verbs each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import remove_placement_group

from rollout.batch import RolloutBatch
from rollout.config import SyntheticDatasetConfig
from rollout.manager import RolloutManagerActor
from rollout.tiny import resolve_model_path
from services.config import ConfigError, JobConfig, load_job_config
from services.controller_client import controller_sinks
from services.evaluation import eval_metrics, is_eval_step
from services.metrics import (
    EVENTS_FILE,
    METRICS_FILE,
    UPDATES_FILE,
    JsonlSink,
    MetricsSink,
    TensorBoardSink,
    truncate_after,
)
from services.placement import phase_threads, reserve_job
from services.preflight import preflight
from services.warmup import warm_start
from trainer import checkpoint
from trainer.aggregation import LENGTH_BUCKETS, length_bias
from trainer.group import TrainerGroup, TrainerRankDied
from trainer.mini_batches import Update, mini_batch, rollout_updates

QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TRANSFORMERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1",
             "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "OMP_NUM_THREADS": "1"}


def quiet_transformers() -> None:
    """No per-load progress bars or advisory warnings in the driver's log."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()


def data_dir() -> Path:
    return Path(os.environ.get("TALLY_DATA_DIR", Path.home() / ".tally"))


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
        return False
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": dict(QUIET_ENV)}, logging_level="WARNING")
    return True


WALL_CLOCK_METADATA = ("rollout/gen_start_time", "rollout/gen_end_time")
"""Batch metadata that is a moment, not a measure: used for perf/gen_overlap, not logged."""
PENDING_ROLLOUTS = "pending_rollouts.pt"
"""In a checkpoint of an async job: the rollouts generated for the steps after it."""

SPREAD_METRICS = ("pg_loss", "clip_fraction", "kl", "grad_norm", "ratio/mean_abs_dev")
"""Trainer metrics that also get their min and max over a rollout's updates."""


def rollout_train_metrics(per_update: list[dict[str, float]]) -> dict[str, float]:
    """A rollout's trainer metrics: the mean over its updates (each update's J is exact
    for its own mini-batch), min/max of a few, compute summed, the last lr."""
    names = [k for k in per_update[0] if k != "valid_tokens"]
    out = {k: sum(u[k] for u in per_update) / len(per_update) for k in names}
    for name in SPREAD_METRICS:
        out[f"{name}/min"] = min(u[name] for u in per_update)
        out[f"{name}/max"] = max(u[name] for u in per_update)
    out["perf/compute_s"] = sum(u["perf/compute_s"] for u in per_update)
    out["lr"] = per_update[-1]["lr"]
    out["updates"] = float(len(per_update))
    return out


def length_bias_metrics(batch: RolloutBatch, constant_divisor: float) -> dict[str, float]:
    """``length_bias/<mode>/<short|middle|long>``: each mode's share of the batch's weight
    on its thirds of responses by valid tokens M_i (trainer.aggregation.length_bias).
    With several updates per rollout it views the rollout's batch as one step."""
    shares = length_bias(batch.sample_token_counts, batch.group_index, constant_divisor,
                         group_size=batch.samples_per_prompt)
    return {f"length_bias/{mode}/{bucket}": share for mode, by_bucket in shares.items()
            for bucket, share in zip(LENGTH_BUCKETS, by_bucket, strict=True)}


def step_metrics(batch: RolloutBatch, per_update: list[dict[str, float]],
                 times: dict[str, float], constant_divisor: float) -> dict[str, float]:
    """Everything the dashboard plots for one rollout; ``constant_divisor`` is the L of
    the constant mode's metrics (ObjectiveConfig.mode_metric_divisor)."""
    step_time = sum(times.values())
    num_tokens = float(batch.sequence_lengths.sum())
    return {
        **{k: float(v) for k, v in batch.metadata.items() if k not in WALL_CLOCK_METADATA},
        **rollout_train_metrics(per_update),
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std()) if batch.num_samples > 1 else 0.0,
        "response_length/mean": float(batch.response_lengths.float().mean()),
        "tokens/valid": float(batch.num_valid_tokens),
        "tokens/total": num_tokens,
        "perf/tokens_per_s": num_tokens / max(step_time, 1e-9),
        "perf/step_time_s": step_time,
        **{f"perf/{name}_s": value for name, value in times.items()},
        **length_bias_metrics(batch, constant_divisor),
    }


def pipeline_metrics(batch: RolloutBatch, step: int,
                     train_windows: dict[int, tuple[float, float]]) -> dict[str, float]:
    """``rollout/staleness``: how many weight versions older than this step's the
    rollout's weights were (0 synchronous, ≤ rollout.async_steps); ``perf/gen_overlap``:
    the share of its generation time that ran while the trainer computed."""
    start, end = batch.metadata["rollout/gen_start_time"], batch.metadata["rollout/gen_end_time"]
    hidden = sum(max(0.0, min(end, t1) - max(start, t0)) for t0, t1 in train_windows.values())
    return {"rollout/staleness": step - batch.metadata["rollout/weight_version"],
            "perf/gen_overlap": hidden / max(end - start, 1e-9)}


def threaded(config: JobConfig, model_path: str):
    """The trainer and rollout configs with their threads per phase resolved."""
    engine_threads, rank_threads = phase_threads(config, model_path)
    engine = config.rollout.engine
    if hasattr(engine, "num_threads"):
        engine = engine.model_copy(update={"num_threads": engine_threads})
    return (config.trainer.model_copy(update={"num_threads": rank_threads}),
            config.rollout.model_copy(update={"engine": engine}))


def job_model_path(config: JobConfig, log=print) -> str:
    """The local model folder a job starts from: ``tiny`` built once, a warm start cached."""
    model_path = resolve_model_path(config.rollout.model, data_dir() / "models")
    if config.warmup.enabled:
        assert isinstance(config.rollout.dataset, SyntheticDatasetConfig)
        model_path = warm_start(model_path, config.rollout.dataset, config.warmup,
                                data_dir() / "warmup", log)
    return model_path


class Job:
    """The actors of one job and the verbs of its loop."""

    def __init__(self, config: JobConfig, output_dir: Path, log=print) -> None:
        self.config, self.output_dir, self.log = config, output_dir, log
        self.objective = config.objective_config()  # what the trainer runs and L of metrics
        self.model_path = model_path = job_model_path(config, log)
        trainer_config, rollout_config = threaded(config, model_path)
        gang = reserve_job(config, on_wait=lambda message: (
            log(message), write_event(output_dir, "waiting", message)))
        self.engine_group = gang.group  # the whole job's group; close() removes it
        # The manager (and its engines) start loading now, while the trainer ranks do.
        self.rollout = RolloutManagerActor.options(
            runtime_env={"env_vars": QUIET_ENV}, **gang.manager_options()).remote(
            rollout_config, model_path, None, gang.engine_options)
        try:
            self.trainer = TrainerGroup(trainer_config, self.objective, model_path,
                                        config.num_optimizer_steps, env_vars=QUIET_ENV,
                                        placement=gang.group)
        except BaseException:
            ray.kill(self.rollout)
            remove_placement_group(gang.group)
            raise
        self.checkpoint_root = output_dir / "checkpoints"
        self.updates = JsonlSink(output_dir, UPDATES_FILE)  # one row per optimizer step
        self.in_flight: dict[int, ray.ObjectRef] = {}  # rollouts asked for, by step
        self.restored: dict[int, RolloutBatch] = {}  # in-flight rollouts a checkpoint kept
        self.train_windows: dict[int, tuple[float, float]] = {}  # wall clock, by step
        self.weights_in_flight: ray.ObjectRef | None = None  # a sync not waited for yet

    def request_rollouts(self, step: int, lookahead: int) -> None:
        """Ask the manager for the rollouts of steps step … step + lookahead not asked for
        yet. It answers them in order, each from the weights it holds when it starts:
        asked for before step ``step`` trains, rollout s is generated from the weights
        of step s − lookahead at the latest (staleness ≤ lookahead)."""
        for later in range(step, min(step + lookahead, self.config.num_steps - 1) + 1):
            if later not in self.in_flight and later not in self.restored:
                self.in_flight[later] = self.rollout.generate_batch.remote(later)

    def take_rollout(self, step: int) -> tuple[RolloutBatch, ray.ObjectRef | None]:
        """Step ``step``'s rollout (waiting for it) and its object-store ref, if any."""
        if step in self.restored:
            return self.restored.pop(step), None
        ref = self.in_flight.pop(step)
        return self.rollout_call(ref, "generate_batch"), ref

    def rl_step(self, step: int, lookahead: int | None = None) -> dict[str, float]:
        """Generate → score → train → sync weights; returns the step's metrics.

        With ``rollout.async_steps`` = k the rollouts of the next k steps are asked for
        before this one trains, so the engines generate while the trainer computes.
        ``lookahead`` overrides k for this call (0: wait for the newest weights)."""
        started = time.perf_counter()
        self.request_rollouts(step, self.config.rollout.async_steps
                              if lookahead is None else lookahead)
        batch, batch_ref = self.take_rollout(step)
        generated = time.perf_counter()
        if batch.num_valid_tokens == 0:  # nothing to learn from: skip, never NaN
            return {"skipped": 1.0, "reward/mean": float(batch.rewards.mean())}
        train_started = time.time()
        updates = rollout_updates(batch, self.config.rollout.global_batch_size,
                                  self.config.trainer.ppo_epochs, self.config.trainer.seed, step)
        if len(updates) > 1 and self.config.trainer.loss.old_log_probs == "trainer":
            batch = batch.with_old_log_probs(self.trainer.log_probs(batch))  # π at the start
            batch_ref = None  # the stored batch has no old log-probs
        per_update = []
        for update in updates:  # fetched once; each mini-batch planned here on its own
            mini = mini_batch(batch, update)
            stored = batch_ref if mini is batch else None
            per_update.append(self.trainer.train(mini, stored))
            self.write_update(step, update, per_update[-1])
        trained = time.perf_counter()
        self.train_windows = {s: w for s, w in self.train_windows.items()
                              if s >= step - self.config.rollout.async_steps}
        self.train_windows[step] = (train_started, time.time())
        self.sync_weights(version=step + 1, wait=False)
        synced = time.perf_counter()
        times = {"rollout": generated - started, "train": trained - generated,
                 "sync": synced - trained}
        return {**step_metrics(batch, per_update, times, self.objective.mode_metric_divisor),
                **pipeline_metrics(batch, step, self.train_windows)}

    def sync_weights(self, version: int, wait: bool = True) -> None:
        """The trainer's weights to every engine (zero-copy numpy arrays in the object
        store); ``version``: the rollouts trained into them. ``wait=False`` returns once
        the ranks exported: the engines load while the driver logs the step, and the next
        call to the manager (queued after the load) checks it succeeded first."""
        ref = self.rollout.update_weights.remote(
            [self.trainer.async_export_weights(for_engines=True)], version)
        if wait:
            self.rollout_call(ref, "update_weights")
        else:
            self.weights_in_flight = ref

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy and pass@k of the weights step ``step`` starts from, at the
        steps ``eval`` names; {} at the others."""
        config = self.config.eval
        if not is_eval_step(step, self.config.num_steps, config):
            return {}
        started = time.perf_counter()
        temperature = config.temperature or self.config.rollout.sampling.temperature
        outcomes = self.rollout_call(self.rollout.evaluate.remote(
            self.config.eval_dataset(), config.num_prompts, config.num_samples, temperature,
            step), "evaluate")
        return {**eval_metrics(outcomes, config), "perf/eval_s": time.perf_counter() - started}

    def rollout_call(self, ref: ray.ObjectRef, verb: str) -> Any:
        """The rollout manager's answer; past rollout.call_timeout_s a TimeoutError, which
        restarts the job from its last checkpoint like a stuck trainer call."""
        try:
            if self.weights_in_flight is not None:  # a sync not waited for: its answer first
                pending, self.weights_in_flight = self.weights_in_flight, None
                ray.get(pending, timeout=self.config.rollout.call_timeout_s)
            return ray.get(ref, timeout=self.config.rollout.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"rollout {verb} took longer than rollout.call_timeout_s="
                               f"{self.config.rollout.call_timeout_s:g} s") from None

    def write_update(self, step: int, update: Update, metrics: dict[str, float]) -> None:
        """One optimizer step's trainer metrics, tagged with its rollout and update."""
        index = step * self.config.num_updates_per_rollout + update.index
        self.updates.write(index, {**metrics, "rollout": float(step),
                                   "update": float(update.index), "epoch": float(update.epoch)})

    def save_checkpoint(self, step: int) -> Path:
        """Trainer state, rollout cursor and step; written aside, then renamed."""
        staging = checkpoint.staging_path(self.checkpoint_root, step)
        self.trainer.save_checkpoint(str(staging))
        if self.in_flight or self.restored:  # async: rollouts generated from older weights
            pending = {**self.restored, **{s: self.rollout_call(ref, "generate_batch")
                                           for s, ref in self.in_flight.items()}}
            torch.save(pending, staging / PENDING_ROLLOUTS)
        rollout_state = self.rollout_call(self.rollout.state_dict.remote(), "state_dict")
        (staging / "driver_state.json").write_text(json.dumps({"step": step,
                                                              "rollout": rollout_state}))
        return checkpoint.commit_checkpoint(self.checkpoint_root, step)

    def restore(self, truncate_metrics: bool = True) -> int:
        """Resume from the newest readable committed checkpoint (an unreadable one is
        reported as an event and the one before it tried); returns the next step."""
        if not self.config.resume:
            return 0
        for latest in checkpoint.checkpoints(self.checkpoint_root):
            reason = checkpoint.unreadable(latest)
            if reason is None:
                break
            write_event(self.output_dir, "checkpoint_unreadable",
                        f"{latest.name}: {reason}; trying the one before")
            self.log(f"checkpoint {latest.name} is unreadable ({reason})")
        else:
            return 0
        state = json.loads((latest / "driver_state.json").read_text())
        self.trainer.load_checkpoint(str(latest))
        self.rollout_call(self.rollout.load_state_dict.remote(state["rollout"]),
                          "load_state_dict")
        self.sync_weights(version=state["step"] + 1)
        if (latest / PENDING_ROLLOUTS).exists():  # the async rollouts in flight at the save
            self.restored = torch.load(latest / PENDING_ROLLOUTS, weights_only=False)
        if truncate_metrics:  # a new run repeats the steps after the checkpoint
            truncate_after(self.output_dir / METRICS_FILE, state["step"])
            truncate_after(self.output_dir / UPDATES_FILE,
                           (state["step"] + 1) * self.config.num_updates_per_rollout - 1)
        self.log(f"resumed from {latest.name} (step {state['step']})")
        return state["step"] + 1

    def placement(self) -> str:
        """Where each actor landed, for the job's log and events."""
        engine_nodes = self.rollout_call(self.rollout.engine_nodes.remote(), "engine_nodes")
        return (f"trainer ranks on nodes {[n[:8] for n in self.trainer.worker_nodes()]}; "
                f"rollout engines on nodes {[n[:8] for n in engine_nodes]}")

    def close(self) -> None:
        """Stop every actor of the job, dead or alive, without waiting on a stuck one."""
        self.updates.close()
        self.trainer.shutdown()
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.rollout.shutdown.remote(), timeout=60)
        ray.kill(self.rollout)
        if self.engine_group is not None:
            remove_placement_group(self.engine_group)


def progress_line(step: int, num_steps: int, history: list[dict[str, float]]) -> str:
    metrics = history[-1]
    if metrics.get("skipped"):
        return f"step {step + 1}/{num_steps} | skipped: no valid token in the batch"
    recent = [m["reward/mean"] for m in history[-10:]]
    return (f"step {step + 1}/{num_steps} | reward {metrics['reward/mean']:.3f} "
            f"(last 10: {sum(recent) / len(recent):.3f}) "
            f"| pg_loss {metrics['pg_loss']:+.4f} | {metrics['perf/tokens_per_s']:,.0f} tok/s "
            f"| {metrics['perf/step_time_s']:.1f} s "
            f"| padding {metrics.get('padding_fraction', 0.0):.1%}"
            + (f" | {metrics['updates']:.0f} updates, clip ≤ {metrics['clip_fraction/max']:.3f}"
               if metrics.get("updates", 1) > 1 else "")
            + (f" | eval accuracy {metrics['eval/accuracy']:.3f}"
               + (f" pass@{metrics['eval/k']:.0f} {metrics['eval/pass@k']:.3f}"
                  if "eval/pass@k" in metrics else "")
               if "eval/accuracy" in metrics else ""))


def default_output_dir(config: JobConfig) -> Path:
    if config.output_dir:
        return Path(config.output_dir)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return data_dir() / "jobs" / f"{config.name}-{stamp}"


class JobFailed(RuntimeError):
    """The job stopped for good (an actor died and the restarts are used up)."""


def write_event(output_dir: Path, kind: str, message: str) -> None:
    """Job events (placement, failures, restarts) for the log and the controller."""
    with (output_dir / EVENTS_FILE).open("a", encoding="utf-8") as events:
        events.write(json.dumps({"time": time.time(), "kind": kind, "message": message}) + "\n")


def run_job(config: JobConfig, output_dir: Path | None = None,
            extra_sinks: list[MetricsSink] | None = None, log=print,
            after_step: Callable[[int, Job], None] | None = None) -> list[dict[str, float]]:
    """Run a whole job; returns every step's metrics. Starts Ray if none is running.

    When an actor dies, the actors are started again and the job resumes from its last
    checkpoint, at most ``max_restarts`` times; metrics already written are kept.
    """
    preflight(config)
    quiet_transformers()
    output_dir = output_dir or default_output_dir(config)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.json").write_text(config.model_dump_json(indent=2))
    for warning in config.warnings():  # inert options: run, but say so
        log(f"warning: {warning.field}: {warning.message}")
        write_event(output_dir, "config_warning", f"{warning.field}: {warning.message}")
    needed = config.trainer.world_size * config.trainer.num_cpus_per_rank + 2
    started_ray = ensure_ray(max(os.cpu_count() or 1, int(needed + 0.999)))
    sinks: list[MetricsSink] = [JsonlSink(output_dir), TensorBoardSink(output_dir),
                                *(extra_sinks or [])]
    history: dict[int, dict[str, float]] = {}
    restarts = 0
    try:
        while True:
            job = None
            try:
                job = Job(config, output_dir, log)
                write_event(output_dir, "placement", job.placement())
                start = job.restore(truncate_metrics=restarts == 0)
                log(f"job {config.name}: steps {start + 1}..{config.num_steps}, "
                    f"mode={config.aggregation.mode}, dp={config.trainer.dp_size} "
                    f"cp={config.trainer.cp_size}, output {output_dir}")
                for step in range(start, config.num_steps):
                    metrics = {**job.evaluate(step), **job.rl_step(step),
                               "job/restarts": float(restarts)}
                    for sink in sinks:
                        sink.write(step, metrics)
                    history = {k: v for k, v in history.items() if k < step} | {step: metrics}
                    log(progress_line(step, config.num_steps, list(history.values())))
                    last = step == config.num_steps - 1
                    if last or (config.checkpoint_every
                                and (step + 1) % config.checkpoint_every == 0):
                        job.save_checkpoint(step)
                    if after_step is not None:
                        after_step(step, job)
                return list(history.values())
            except (TrainerRankDied, ray.exceptions.RayActorError, TimeoutError) as err:
                reason = str(err).splitlines()[0]
                write_event(output_dir, "actor_failed", reason)
                if restarts >= config.max_restarts:
                    raise JobFailed(f"job {config.name}: {reason} (restarts used: "
                                    f"{restarts}/{config.max_restarts})") from err
                restarts += 1
                write_event(output_dir, "restart", f"restart {restarts}/{config.max_restarts} "
                            "from the last checkpoint")
                log(f"{reason}; restarting ({restarts}/{config.max_restarts}) from the last "
                    "checkpoint")
            finally:
                if job is not None:
                    job.close()
    finally:
        for sink in sinks:
            sink.close()
        if started_ray:
            ray.shutdown()


def train_from_cli(config_path: str | Path, overrides: list[str] | None = None,
                   output_dir: Path | None = None) -> int:
    """The one entry point of a job from a command line (``tally train`` and
    ``python -m services.train``): load and preflight the config (a ConfigError goes to
    stderr, exit code 2), then run it, reporting to the controller when
    ``TALLY_CONTROLLER_URL`` is set. Returns the exit code."""
    try:
        config = load_job_config(config_path, overrides or [])
        preflight(config)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    output_dir = output_dir or default_output_dir(config)
    with controller_sinks(config, output_dir) as sinks:  # [] unless TALLY_CONTROLLER_URL
        run_job(config, output_dir, extra_sinks=sinks)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.train",
                                     description="Run one Tally RL job.")
    parser.add_argument("config", help="YAML job config")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a field, e.g. trainer.optimizer.lr=1e-5")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    return train_from_cli(args.config, args.overrides, args.output_dir)


if __name__ == "__main__":
    sys.exit(main())
