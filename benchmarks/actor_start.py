"""What one Ray actor's start costs in CPU, on a head started as a job starts one
(services/runtime/gang.py ``start_local_head``), with and without a ``runtime_env`` on
the actor, side by side in one run (issue 51: the suite's time is mostly actor starts).

For each of the three kinds of actor a job starts most (a policy rank's module, an
engine's, the rollout manager's), the same actor class is started ``--repeats`` times
in each mode, one at a time, and asked once for its process's CPU seconds so far
(``os.times``: user + system of the whole process, the interpreter, Ray's worker set-up
and the imports of the actor's module included; ``__init__`` does nothing):

    plain        no runtime_env: the head's workers inherit its quiet environment, and the
                 actor may take a worker the head started ahead
    runtime_env  ``runtime_env={"env_vars": QUIET_ENV}`` (what every actor carried
                 before): Ray starts its worker through ``setup_worker``, a second
                 interpreter that imports Ray before it execs the worker

Printed per kind: mean CPU-s of each mode, their difference and ratio, and the wall
seconds from ``.remote()`` to the answer. The machine is shared: compare the ratios.

    .venv/bin/python benchmarks/actor_start.py [--repeats 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray

from services.runtime.gang import actor_options, start_local_head
from services.runtime.quiet import QUIET_ENV

KINDS = {"policy rank": "trainer.backends.fsdp.worker", "engine": "rollout.engines.torch_engine",
         "manager": "rollout.manager"}
"""What each kind's actor imports: the module its class lives in."""


class Probe:
    """An actor that imports one module when Ray builds it, and says its CPU so far."""

    def __init__(self, module: str) -> None:
        import importlib

        importlib.import_module(module)

    def cpu(self) -> float:
        times = os.times()
        return times.user + times.system


def start_cost(module: str, runtime_env: bool) -> tuple[float, float]:
    """(CPU-s of the actor's process at its first answer, wall-s from .remote())."""
    options = {"runtime_env": {"env_vars": dict(QUIET_ENV)}} if runtime_env else actor_options()
    began = time.perf_counter()
    actor = ray.remote(num_cpus=0)(Probe).options(**options).remote(module)
    try:
        cpu = ray.get(actor.cpu.remote(), timeout=300)
    finally:
        ray.kill(actor)
    return cpu, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    start_local_head(2, log_to_driver=False)
    try:
        time.sleep(3)  # the head's own start-up done before the first actor
        print(f"{'actor':<12} {'plain CPU-s':>11} {'runtime_env CPU-s':>17} {'diff':>6} "
              f"{'ratio':>6} {'plain wall-s':>12} {'runtime_env wall-s':>18}")
        for kind, module in KINDS.items():
            got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for repeat in range(args.repeats):
                for runtime_env in (False, True):  # interleaved: drift hits both alike
                    got[runtime_env].append(start_cost(module, runtime_env))
                print(f"  {kind}: {repeat + 1}/{args.repeats}", file=sys.stderr)
            plain, env = ([statistics.mean(c for c, _ in got[m]) for m in (False, True)])
            plain_wall, env_wall = ([statistics.mean(w for _, w in got[m])
                                     for m in (False, True)])
            print(f"{kind:<12} {plain:>11.2f} {env:>17.2f} {env - plain:>6.2f} "
                  f"{env / plain:>6.2f} {plain_wall:>12.2f} {env_wall:>18.2f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
