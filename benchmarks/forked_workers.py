"""What starting a job's actors costs with workers forked from a zygote
(services/runtime/forked_workers.py) against fresh interpreters (``start_local_head``'s
``fork_workers`` on and off), side by side in one run (issue 51: the suite's time is
mostly actor starts).

Each repeat, for each mode in turn, starts a head as a job does
(services/runtime/gang.py ``start_local_head``, 2 CPUs), lets its own start-up settle,
then starts the three actors a job starts most — one importing a policy rank's module,
one an engine's, one the rollout manager's — at once, and waits for each to answer.
Measured from ``/proc/stat`` around that step: the CPU-seconds the whole machine spent
(the zygote's imports, the launchers and the workers included), and the wall seconds.
The machine is shared and noisy: compare the ratio.

    .venv/bin/python benchmarks/forked_workers.py [--repeats 2]
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

MODULES = ("trainer.backends.fsdp.worker", "rollout.engines.torch_engine", "rollout.manager")
"""One actor per module, as a job's gang starts a rank, an engine and the manager."""


class Probe:
    """An actor that imports one module when Ray builds it."""

    def __init__(self, module: str) -> None:
        import importlib

        importlib.import_module(module)

    def ready(self) -> bool:
        return True


def busy_cpu_s() -> float:
    """CPU-seconds this machine has spent not idle since boot (all cores)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def job_start(fork: bool) -> tuple[float, float]:
    """(CPU-s, wall-s) of starting the three actors on a fresh head."""
    start_local_head(2, fork_workers=fork, log_to_driver=False)
    try:
        time.sleep(5)  # the head's own start-up (and its workers started ahead) done
        cpu, began = busy_cpu_s(), time.perf_counter()
        actors = [ray.remote(num_cpus=0)(Probe).options(**actor_options()).remote(module)
                  for module in MODULES]
        ray.get([actor.ready.remote() for actor in actors], timeout=600)
        return busy_cpu_s() - cpu, time.perf_counter() - began
    finally:
        ray.shutdown()
        time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for repeat in range(args.repeats):
        for fork in (False, True):  # interleaved: drift hits both alike
            got[fork].append(job_start(fork))
        print(f"  {repeat + 1}/{args.repeats}", file=sys.stderr)
    fresh_cpu, forked_cpu = (statistics.mean(c for c, _ in got[m]) for m in (False, True))
    fresh_wall, forked_wall = (statistics.mean(w for _, w in got[m]) for m in (False, True))
    print(f"{'three actors':<14} {'fresh':>8} {'forked':>8} {'ratio':>6}")
    print(f"{'CPU-s':<14} {fresh_cpu:>8.2f} {forked_cpu:>8.2f} {forked_cpu / fresh_cpu:>6.2f}")
    print(f"{'wall-s':<14} {fresh_wall:>8.2f} {forked_wall:>8.2f} "
          f"{forked_wall / fresh_wall:>6.2f}")


if __name__ == "__main__":
    main()
