"""Workers forked from a zygote (services/runtime/forked_workers.py), on a real head: each
is held to the worker the raylet asked for — its launcher, the process the raylet started,
read from /proc — and to Ray's own handling of a worker's death."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from services.runtime import forked_workers

ROOT = Path(__file__).resolve().parents[3]
SET_BY_RAYS_WORKER = {"PYTHONBREAKPOINT": "ray.util.rpdb.set_trace"}
"""What Ray's worker puts in its own environment once running (a fresh one too)."""


@ray.remote(num_cpus=0)
class Probe:
    def __init__(self) -> None:
        self.preloaded = "torch" in sys.modules  # before this actor imported anything

    def seen(self) -> dict:
        import gc

        from ray._raylet import ObjectID

        return {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:],
                "env": dict(os.environ), "cwd": os.getcwd(), "preloaded": self.preloaded,
                "drawn": ObjectID.from_random().hex(),  # Ray's random ids
                # objects a garbage collection walks, and those it leaves out (frozen)
                "collected": len(gc.get_objects()), "frozen": gc.get_freeze_count()}


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")[:-1]
    return dict(pair.split("=", 1) for pair in pairs)


def _launcher_of(seen: dict) -> int:
    """The process the raylet started for this worker: a launcher with its worker id."""
    worker_id = next(a for a in seen["argv"] if a.startswith("--worker-id="))
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = _cmdline(int(entry.name))
            except OSError:
                continue
            if worker_id in argv and argv[1:2] == [forked_workers.__file__]:
                return int(entry.name)
    raise AssertionError(f"no launcher holds {worker_id}")


def _set_by_importing(modules: tuple[str, ...], env: dict[str, str]) -> dict[str, str]:
    """What importing ``modules`` in a fresh interpreter with ``env`` adds to or changes in
    its environment (torch's inductor, for one, sets a cache folder)."""
    code = ("import importlib, json, os, sys; before = dict(os.environ)\n"
            "for name in sys.argv[1:]: importlib.import_module(name)\n"
            "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    done = subprocess.run([sys.executable, "-c", code, *modules], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _gone(pid: int, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        if status[status.rfind(")") + 2] == "Z":  # exited, not yet reaped
            return True
        time.sleep(0.1)
    return False


def test_actors_are_forked_from_one_zygote_as_the_workers_their_launchers_were_asked_for(
        ray_cluster: None) -> None:
    probes = [Probe.remote() for _ in range(2)]
    seen = ray.get([p.seen.remote() for p in probes], timeout=300)
    zygotes = {s["ppid"] for s in seen}
    assert len(zygotes) == 1  # one zygote serves a job's workers of one environment
    zygote = _cmdline(zygotes.pop())
    # forked by the base zygote of its environment (a zygote shows that base's cmdline)
    assert zygote[1:4] == ["-u", forked_workers.__file__, "--base"]
    assert seen[0]["drawn"] != seen[1]["drawn"]  # each child seeded Ray's generator itself
    for one in seen:
        assert one["preloaded"]  # torch came imported from the zygote
        # frozen there: a collection here walks this worker's own objects, not its imports'
        assert one["frozen"] > 100_000 and one["collected"] < one["frozen"] / 2, one
        launcher = _launcher_of(one)
        assert one["argv"] == _cmdline(launcher)[2:]  # Ray's arguments, as given
        # its launcher's environment, with what a fresh worker's own imports would add
        imported = forked_workers.BASE_PRELOAD + forked_workers.PRELOAD
        assert one["env"] == {**_environ(launcher), **SET_BY_RAYS_WORKER,
                              **_set_by_importing(imported, _environ(launcher))}
        assert one["cwd"] == os.readlink(f"/proc/{launcher}/cwd")
        # what /proc shows of it: its base's, the launcher's without a job's or Ray's own
        assert _environ(one["pid"]) == forked_workers.base_env(_environ(launcher))
        assert not any(k.startswith(("RAY_", "TALLY_")) for k in _environ(one["pid"]))
    # a runtime_env that adds a job's own variables, as the controller's jobs do: a zygote
    # of its own kind, forked by the same base, and its variables reach the child
    own_env = Probe.options(runtime_env={"env_vars": {"TALLY_PROBE": "1"}}).remote()
    apart = ray.get(own_env.seen.remote(), timeout=300)
    assert apart["env"]["TALLY_PROBE"] == "1" and apart["preloaded"]
    assert apart["ppid"] not in {s["ppid"] for s in seen}
    assert _cmdline(apart["ppid"]) == _cmdline(seen[0]["ppid"])
    for probe in [*probes, own_env]:
        ray.kill(probe)


def test_a_killed_actor_takes_its_launcher_and_a_killed_launcher_takes_its_actor(
        ray_cluster: None) -> None:
    killed = Probe.remote()
    seen = ray.get(killed.seen.remote(), timeout=300)
    launcher = _launcher_of(seen)
    ray.kill(killed)
    assert _gone(seen["pid"]) and _gone(launcher)

    orphaned = Probe.remote()
    seen = ray.get(orphaned.seen.remote(), timeout=300)
    launcher = _launcher_of(seen)
    os.kill(launcher, signal.SIGKILL)  # as the raylet kills a worker it started
    assert _gone(seen["pid"])
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(orphaned.seen.remote(), timeout=60)


def test_children_draw_fresh_ids_until_their_parent_draws_one() -> None:
    # in a fresh interpreter: this one drew Ray ids as it made its remote classes
    code = ("import ray\n"
            "from services.runtime.forked_workers import forks_draw_fresh_ids as fresh\n"
            "before = fresh()\n"
            "ray.remote(type('Actor', (), {}))  # a class made remote draws its id\n"
            "print(before, fresh())")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]


def test_a_lock_whose_zygote_died_is_taken_over_not_waited_on(tmp_path: Path) -> None:
    """A zygote killed (the OOM killer, a kill -9) leaves its socket and lock behind; the
    next launcher of its kind starts a new one instead of waiting ZYGOTE_START_S on it."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "sockets").mkdir()
    path = str(tmp_path / "sockets" / "tz-test")
    dead = subprocess.Popen(["true"])
    dead.wait()
    Path(path + ".lock").write_text(str(dead.pid))
    Path(path).write_text("")  # the dead zygote's socket
    assert forked_workers._zygote_gone(path) and forked_workers._connect(path) is None
    forked_workers._start_zygote(path)
    holder = forked_workers._lock_holder(path)
    assert holder not in (None, dead.pid)
    try:
        deadline = time.monotonic() + 240
        while (conn := forked_workers._connect(path)) is None and time.monotonic() < deadline:
            assert forked_workers._alive(holder)
            time.sleep(0.2)
        assert conn is not None  # the new zygote listens where the dead one did
        conn.close()
    finally:
        os.kill(holder, signal.SIGKILL)


def test_a_socket_names_its_session_and_the_kind_of_worker_and_fits_a_unix_path() -> None:
    args = ["--temp-dir=/tmp/ray", "--session-name=session_1", "--worker-id=ab"]
    path = forked_workers.zygote_socket(args, {"RAY_JOB_ID": "01000000"}, "/work")
    assert path and path.startswith("/tmp/ray/session_1/sockets/tz-")
    assert path == forked_workers.zygote_socket(args, {"RAY_JOB_ID": "01000000"}, "/work")
    assert path != forked_workers.zygote_socket(args, {"RAY_JOB_ID": "02000000"}, "/work")
    assert path != forked_workers.zygote_socket(args, {"RAY_JOB_ID": "01000000"}, "/tmp")
    long_temp = ["--temp-dir=/tmp/" + "t" * 80, "--session-name=session_1"]
    assert forked_workers.zygote_socket(long_temp, {}, "/work") is None  # the worker execs
    assert forked_workers.zygote_socket(["--worker-id=ab"], {}, "/work") is None


ZYGOTE_ENDS_SCRIPT = """
import json, os, sys, time
import ray
from services.runtime.gang import start_local_head

@ray.remote(num_cpus=0)
def parent():
    stat = open(f"/proc/{os.getppid()}/stat").read()
    grandparent = int(stat[stat.rfind(")") + 2:].split()[1])
    tail = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")[-4:-1]
    return os.getppid(), grandparent, tail

start_local_head(1, log_to_driver=False)
try:
    ppid, grandparent, tail = ray.get(parent.remote(), timeout=240)
finally:
    ray.shutdown()
print(json.dumps({"ppid": ppid, "base": grandparent, "tail": [t.decode() for t in tail]}))
"""


@pytest.mark.slow  # Ray heads of their own, in subprocesses
def test_the_zygote_ends_with_its_head_and_a_head_told_not_to_fork_execs_its_workers(
        ) -> None:
    said = {}
    for fork in ("1", "0"):
        done = subprocess.run([sys.executable, "-c", ZYGOTE_ENDS_SCRIPT], cwd=ROOT,
                              timeout=300, capture_output=True, text=True,
                              env={**os.environ, forked_workers.ENABLE_ENV: fork})
        assert done.returncode == 0, done.stderr[-3000:]
        said[fork] = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["1"]["tail"][0] == "--base"  # a zygote the base zygote forked
    assert _gone(said["1"]["ppid"])  # the zygote did not outlive its head
    assert _gone(said["1"]["base"], within_s=30)  # nor did its base
    assert not {"--zygote", "--base"} & set(said["0"]["tail"])  # the raylet's own child
