"""Where the demo's rollout step spends its time, and how many Ray calls it makes.

Runs the demo config end to end (real Ray, the tiny model on CPU) and prints, per step
(median over the steps after the first two):

1. **Driver phases**, each phase's own time (a nested phase's time is not its parent's):
   evaluation, the wait for the rollout, planning, shipping the batch and plan, the
   train call, the weight sync, the row's metrics, sinks and checkpoint. With the Ray
   calls each phase made (``.remote`` submissions, ``get``/``wait``/``put``) and the
   driver's time blocked in them.
2. **Actor side** (Ray's task timeline): per actor verb, its calls per step, the time
   spent deserializing arguments, executing and storing outputs; the executing time of
   the rollout manager and the ranks split into what the row calls generation
   (``rollout/gen_time_s``) and fwd+bwd+optimizer (``perf/compute_s``).
3. **Orchestration**, as ``benchmarks/step_throughput.py`` defines it: step time −
   exposed generation − fwd+bwd, as a share of the step (target < 10%), and the same
   for the wall clock between two steps' starts (sinks, progress and checkpoint too).

    .venv/bin/python benchmarks/step_profile.py [--steps 12] [--batch 256] [--dp 2]
        [--async-steps 0] [--colocate 0] [--set key=value ...]
        [--compare OTHER_TREE [--rounds 2]]

``--compare`` runs this tree and another checkout (e.g. ``git worktree add /tmp/before
<commit>``) alternately, each in its own process with its own sources, and prints each
run's summary and the medians side by side: before/after in one run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
import ray.actor

ROOT = Path(__file__).resolve().parents[1]


class PhaseClock:
    """Exclusive wall time per phase (a phase inside another is taken out of its
    parent) and the Ray calls made in each, recorded per rollout step."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, float]] = []
        self.step: int | None = None
        self.own: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.calls: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.blocked: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.windows: dict[int, tuple[float, float]] = {}

    @property
    def phase(self) -> str:
        return self.stack[-1][0] if self.stack else "outside a phase"

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        now = time.perf_counter()
        if self.stack and self.step is not None:  # the parent's own time stops here
            parent, since = self.stack[-1]
            self.own[self.step][parent] += now - since
        self.stack.append((phase, now))
        try:
            yield
        finally:
            now = time.perf_counter()
            _, since = self.stack.pop()
            if self.step is not None:
                self.own[self.step][phase] += now - since
            if self.stack:
                self.stack[-1] = (self.stack[-1][0], now)

    def count(self, what: str, seconds: float = 0.0) -> None:
        if self.step is not None:
            self.calls[self.step][f"{self.phase}: {what}"] += 1
            self.blocked[self.step][self.phase] += seconds


def wrap(owner: Any, name: str, phase: str | Callable[[str], str], clock: PhaseClock
         ) -> None:
    """``owner.name`` (a class's method or a module's function) timed as ``phase`` (or
    as ``phase(the phase it is called in)``)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        with clock.timed(phase if isinstance(phase, str) else phase(clock.phase)):
            return original(*args, **kwargs)

    setattr(owner, name, timed)


def count_ray_calls(clock: PhaseClock) -> None:
    """Every ``.remote`` submission and ``ray.get``/``wait``/``put`` of the driver."""
    submit = ray.actor.ActorMethod._remote

    def remote(self: ray.actor.ActorMethod, *args: Any, **kwargs: Any) -> Any:
        clock.count(f"{self._method_name}.remote")
        return submit(self, *args, **kwargs)

    ray.actor.ActorMethod._remote = remote
    for verb in ("get", "wait", "put"):
        original = getattr(ray, verb)

        def blocking(*args: Any, _original: Callable[..., Any] = original,
                     _verb: str = verb, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                clock.count(f"ray.{_verb}", time.perf_counter() - started)

        setattr(ray, verb, blocking)


def instrument(clock: PhaseClock) -> None:
    """The driver's phases, by the functions and methods that do them."""
    from services.driver import checkpoint, loop, metrics, sinks
    from services.driver.evaluation import Evaluation
    from services.driver.pipeline import RolloutPipeline
    from services.driver.weight_sync import WeightSync
    from trainer.group import TrainerGroup

    for owner, name, phase in (
        (Evaluation, "start", "eval"), (Evaluation, "collect", "eval"),
        (RolloutPipeline, "take", "rollout (wait for the batch)"),
        (WeightSync, "poll", "weight sync"), (WeightSync, "start", "weight sync"),
        (WeightSync, "wait", "weight sync"),
        (loop, "train_optimizer_steps", "train (driver side)"),
        (TrainerGroup, "plan", "plan"),
        (TrainerGroup, "_call", lambda parent: "train call (ranks)"
         if parent.startswith("train") else parent),
        (loop, "rollout_metrics", "metrics"), (RolloutPipeline, "metrics", "metrics"),
        (sinks.JsonlSink, "write", "sinks, progress"),
        (sinks.TensorBoardSink, "write", "sinks, progress"),
        (metrics.Progress, "line", "sinks, progress"),
        (loop, "save_checkpoint", "checkpoint"), (checkpoint, "due", "checkpoint"),
    ):
        wrap(owner, name, phase, clock)
    count_ray_calls(clock)
    put = ray.put

    def ship(*args: Any, **kwargs: Any) -> Any:  # a put inside a train call ships
        phase = "ship (put batch, plan)" if clock.phase.startswith("train") else clock.phase
        with clock.timed(phase):
            return put(*args, **kwargs)

    ray.put = ship
    rollout_step = loop.rollout_step

    def step(job: Any, number: int, *args: Any, **kwargs: Any) -> dict[str, float]:
        clock.step = number
        started = time.time()
        with clock.timed("rollout step (rest)"):
            row = rollout_step(job, number, *args, **kwargs)
        clock.windows[number] = (started, time.time())
        return row

    loop.rollout_step = step


def actor_table(events: list[dict[str, Any]], windows: dict[int, tuple[float, float]],
                steps: list[int]) -> dict[str, dict[str, float]]:
    """Per actor verb (``Class.method``): the median over ``steps`` of its calls and of the
    seconds it spent deserializing arguments, executing and storing outputs (summed over
    its actors) in the step (Ray's task timeline; a task counts in the step it started)."""
    by_worker: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and event.get("cat", "").startswith("task:"):
            by_worker[event["tid"]].append(event)
    per_step: dict[str, dict[int, collections.Counter[str]]] = collections.defaultdict(
        lambda: collections.defaultdict(collections.Counter))
    for worker_events in by_worker.values():
        tasks = [e for e in worker_events if e["cat"].startswith("task::")]
        parts = [e for e in worker_events if not e["cat"].startswith("task::")]
        for task in tasks:
            step = next((s for s in steps if windows[s][0] * 1e6 <= task["ts"]
                         < windows[s][1] * 1e6), None)
            if step is None:
                continue
            counts = per_step[task["cat"][len("task::"):]][step]
            counts["calls"] += 1
            counts["total"] += task["dur"] / 1e6
            for part in parts:
                if task["ts"] <= part["ts"] <= task["ts"] + task["dur"]:
                    counts[part["cat"].split(":")[1]] += part["dur"] / 1e6
    return {verb: {k: statistics.median(by_step[s][k] for s in steps)
                   for k in ("calls", "total", "deserialize_arguments", "execute",
                             "store_outputs")}
            for verb, by_step in per_step.items()}


def profile(args: argparse.Namespace) -> tuple[list[str], dict[str, float]]:
    """One run of the demo job under the clock: the report's lines and its summary."""
    from services.config.job import load_job_config
    from services.driver.loop import run_job
    from services.runtime.gang import ensure_ray
    from services.runtime.placement import local_head_cpus

    clock = PhaseClock()
    instrument(clock)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TALLY_DATA_DIR", str(Path(tmp) / "data"))
        config = load_job_config(ROOT / "configs" / "demo.yaml", [
            f"num_steps={args.steps}", f"rollout.global_batch_size={args.batch}",
            "warmup.num_steps=60", f"rollout.async_steps={args.async_steps}",
            f"colocate={str(bool(args.colocate)).lower()}", f"trainer.dp_size={args.dp}",
            *args.set])
        started_ray = ensure_ray(local_head_cpus(config))  # kept up for the timeline
        try:
            rows = run_job(config, Path(tmp) / "job", log=lambda *_: None)
            time.sleep(2.0)  # the workers flush their task events every second
            events = ray.timeline()
        finally:
            if started_ray:
                ray.shutdown()
    steps = list(range(2, args.steps))
    median = {name: statistics.median(rows[s][name] for s in steps)
              for name in ("perf/step_time_s", "rollout/gen_time_s", "perf/compute_s",
                           "perf/gen_overlap")}
    step_s = median["perf/step_time_s"]
    wall = statistics.median(clock.windows[s + 1][0] - clock.windows[s][0]
                             for s in steps[:-1])
    lines = [f"demo step profile: batch {args.batch}, DP {args.dp}, async_steps "
             f"{args.async_steps}, colocate {args.colocate}; median of steps "
             f"{steps[0]}..{steps[-1]}; step {step_s * 1e3:.0f} ms (row), "
             f"{wall * 1e3:.0f} ms start to start",
             f"\n{'driver phase (own time)':<32} {'ms/step':>8} {'of step':>8} "
             f"{'in Ray calls':>12}  Ray calls per step"]
    phases = sorted({p for s in steps for p in clock.own[s]},
                    key=lambda p: -statistics.median(clock.own[s][p] for s in steps))
    for phase in phases:
        own = statistics.median(clock.own[s][phase] for s in steps)
        blocked = statistics.median(clock.blocked[s][phase] for s in steps)
        calls = collections.Counter[str]()
        for s in steps:
            calls.update({k.split(": ", 1)[1]: v for k, v in clock.calls[s].items()
                          if k.startswith(phase + ": ")})
        said = ", ".join(f"{what} ×{n / len(steps):g}" for what, n in sorted(calls.items()))
        lines.append(f"{phase:<32} {own * 1e3:>8.1f} {own / wall:>8.1%} "
                     f"{blocked * 1e3:>10.1f}ms  {said}")
    total_calls = sum(sum(clock.calls[s].values()) for s in steps) / len(steps)
    lines.append(f"{'Ray calls from the driver':<32} {total_calls:>8.1f} per step")
    lines.append(f"\n{'actor verb':<42} {'calls':>6} {'total ms':>9} {'deser ms':>9} "
                 f"{'exec ms':>8} {'store ms':>9}")
    actors = actor_table(events, clock.windows, steps)
    for verb, part in sorted(actors.items(), key=lambda kv: -kv[1]["total"]):
        lines.append(f"{verb:<42} {part['calls']:>6.1f} {part['total'] * 1e3:>9.1f} "
                     f"{part['deserialize_arguments'] * 1e3:>9.1f} "
                     f"{part['execute'] * 1e3:>8.1f} {part['store_outputs'] * 1e3:>9.1f}")
    generate, compute = median["rollout/gen_time_s"], median["perf/compute_s"]
    exposed = generate * (1 - median["perf/gen_overlap"])
    orchestration = max(0.0, step_s - exposed - compute)
    lines += [f"\nrow: generation {generate * 1e3:.0f} ms ({exposed * 1e3:.0f} exposed), "
              f"fwd+bwd+optimizer {compute * 1e3:.0f} ms (rank 0)",
              f"orchestration (step_throughput's): {orchestration * 1e3:.0f} ms = "
              f"{orchestration / step_s:.1%} of the step; of the wall clock between step "
              f"starts: {(wall - exposed - compute) / wall:.1%}"]
    return lines, {"step_ms": step_s * 1e3, "wall_ms": wall * 1e3,
                   "generation_ms": exposed * 1e3, "compute_ms": compute * 1e3,
                   "orchestration": orchestration / step_s, "ray_calls": total_calls}


def compare(args: argparse.Namespace) -> None:
    """This tree and ``args.compare`` alternately, ``args.rounds`` times each (a noisy
    machine slows both alike): each run's summary, then the medians side by side."""
    import json
    import subprocess
    import sys

    trees = {"this": ROOT, "other": Path(args.compare).resolve()}
    passed = [f"--steps={args.steps}", f"--batch={args.batch}", f"--dp={args.dp}",
              f"--async-steps={args.async_steps}", f"--colocate={args.colocate}",
              *(f"--set={override}" for override in args.set)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    print(f"{'tree':<6} {'round':>5} {'step ms':>8} {'wall ms':>8} {'exposed gen':>11} "
          f"{'fwd+bwd':>8} {'orchestration':>13} {'Ray calls':>9}")
    for round_ in range(args.rounds):
        for name, tree in trees.items():
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, __file__, *passed, "--json", out.name],
                               cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                               check=True, stdout=subprocess.DEVNULL)
                run = json.loads(Path(out.name).read_text())
            runs[name].append(run)
            print(f"{name:<6} {round_:>5} {run['step_ms']:>8.0f} {run['wall_ms']:>8.0f} "
                  f"{run['generation_ms']:>11.0f} {run['compute_ms']:>8.0f} "
                  f"{run['orchestration']:>13.1%} {run['ray_calls']:>9.1f}", flush=True)
    for name, tree in trees.items():
        middle = {k: statistics.median(r[k] for r in runs[name]) for k in runs[name][0]}
        print(f"median {name} ({tree}): step {middle['step_ms']:.0f} ms, orchestration "
              f"{middle['orchestration']:.1%}, {middle['ray_calls']:.1f} Ray calls a step")


def main() -> None:
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=256, help="rollout.global_batch_size")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--async-steps", type=int, default=0)
    parser.add_argument("--colocate", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="more overrides")
    parser.add_argument("--compare", help="another source tree: runs alternate with it")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree (--compare)")
    parser.add_argument("--json", help="also write the run's summary here")
    args = parser.parse_args()
    if args.compare:
        compare(args)
        return
    lines, summary = profile(args)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
