"""What a Ray head's log monitor costs in CPU, with Ray's default polling and with
HEAD_ENV (services/runtime/quiet.py: new log files looked for every 0.5 s rather than on
each 0.1 s poll), side by side in one run. Each mode starts a head as a job starts one
(``start_local_head``, a subprocess per head), keeps ``--actors`` idle actors alive (each
has its log files) and reads the log monitor's CPU seconds over ``--seconds``; the modes
alternate ``--repeats`` times. The machine is shared: compare the ratio.

    .venv/bin/python benchmarks/log_monitor.py [--actors 8] [--seconds 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE_HEAD = """
import json, os, sys, time
import ray
from services.runtime import gang, quiet

if sys.argv[1] == "default":
    quiet.HEAD_ENV.clear()  # the head gets Ray's own polling
gang.start_local_head(4, log_to_driver=True, configure_logging=False)  # a job's head
flag = f"--gcs-address={ray.get_runtime_context().gcs_address}".encode()


@ray.remote(num_cpus=0)
class Idle:
    def ping(self) -> int:
        return 1


def monitor_cpu() -> float:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmd:
                words = cmd.read().split(b"\\0")
            if any(w.endswith(b"log_monitor.py") for w in words) and flag in words:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    raise SystemExit("no log monitor found")


actors = [Idle.remote() for _ in range(int(sys.argv[2]))]
ray.get([a.ping.remote() for a in actors])
before = monitor_cpu()
time.sleep(float(sys.argv[3]))
print(json.dumps(monitor_cpu() - before))
ray.shutdown()
"""


def one(mode: str, actors: int, seconds: float) -> float:
    done = subprocess.run([sys.executable, "-c", ONE_HEAD, mode, str(actors), str(seconds)],
                          cwd=ROOT, capture_output=True, text=True, timeout=seconds + 180)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cpu: dict[str, list[float]] = {"default": [], "HEAD_ENV": []}
    for repeat in range(args.repeats):
        for mode in cpu:
            cpu[mode].append(one(mode, args.actors, args.seconds))
            print(f"repeat {repeat + 1}/{args.repeats} {mode}: {cpu[mode][-1]:.2f} CPU-s",
                  flush=True)
    default, ours = (statistics.mean(cpu[m]) for m in cpu)
    per_minute = 60 / args.seconds
    print(f"log monitor CPU-s a minute, {args.actors} idle actors: default "
          f"{default * per_minute:.2f}, HEAD_ENV {ours * per_minute:.2f}, ratio "
          f"{ours / default:.2f}")


if __name__ == "__main__":
    main()
