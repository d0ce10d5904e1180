"""Ray workers forked from a warm interpreter, on a head we start with forking on
(:data:`ENABLE_ENV`; issue 51: most of the suite's CPU, and of a job's start, is each
actor's fresh interpreter importing torch and transformers: 5–9 CPU-s an actor on a
slow day, ``benchmarks/actor_start.py``).

The raylet starts every worker as ``python -u <worker_path> <args>``;
:func:`services.runtime.gang.start_local_head` names this file as that path. Run so, it is
the *launcher*: it imports nothing but the standard library and hands its worker to a
*zygote*, a process that has imported Ray, torch, transformers and the modules of our
actors once (:data:`PRELOAD`) and forks a child per worker. The child takes the
launcher's stdin/stdout/stderr, environment, working directory and arguments, and runs
Ray's ``default_worker.py`` as ``__main__``, exactly as a fresh worker would::

    raylet ─► launcher: python -u forked_workers.py ARGS ──unix socket──► zygote
               (waits, passes on SIGTERM/SIGINT,                            │ fork
                exits with the child's code)                                ▼
                                                 child: default_worker.py ARGS

The child registers with the raylet itself, under its own pid (Ray takes a worker's pid
from its registration), so ``ray.kill``, a worker's death and its logs are as usual.

Why one zygote per environment: Ray's C++ config is read from ``RAY_*`` variables once,
when ``ray`` is imported (a worker's job id among them: a worker started ahead has
``RAY_JOB_ID=ffffffff``, one started for a job has that job's), so a zygote serves only
launchers whose environment, working directory and interpreter equal the one it was
started from; its socket is named by their hash. The first launcher of a kind has it
started with its own environment and every launcher of that kind waits for it
(:data:`ZYGOTE_START_S`). A zygote is forked by a *base* zygote, one per environment
without :data:`KIND_ONLY_PREFIXES` (started by the first launcher that needs it), which
imports only third-party modules (:data:`BASE_PRELOAD`, never Ray), so each kind's
zygote pays only for Ray and our modules on top. A forked child's
``/proc/<pid>/environ`` is its base's, which is its launcher's without ``RAY_*`` and
``TALLY_*``: a job's workers hold no more than their own launcher held.

A worker with a ``runtime_env`` is forked too, by a zygote of its own kind: Ray's
``setup_worker`` applies the runtime env (its variables, folder, interpreter) before it
runs the launcher, so what it changes is in what names the zygote. On the controller's
head (services/runtime/ray_start.py) a job's supervisor, its actors and each session
get one each, all forked from one base zygote.

Anything unusual runs the worker the ordinary way (``exec`` of ``default_worker.py``):
forking turned off (``TALLY_FORK_WORKERS=0``); a socket path longer than a unix socket
allows; a zygote that did not come up in time, died, or cannot fork safely. The zygote
ends when the raylet is gone, or once it has had no live child for :data:`ZYGOTE_IDLE_S`
(a finished job's zygote does not linger), a base likewise with no zygote. A child
whose launcher is killed ends too (it watches the launcher's connection).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable

ENABLE_ENV = "TALLY_FORK_WORKERS"
"""``0`` turns forking off for the heads :func:`services.runtime.gang.start_local_head`
starts (every program's own head when no cluster is given: ``ensure_ray``; the suite's
shared heads), so every worker is a fresh
interpreter, as Ray starts it; on by default (it was off for one session, after a hang
this module's :func:`forks_draw_fresh_ids` explains). The head's processes get it, ``1``
or ``0``, so its launchers know."""

FORKING_HEAD_ENV = {"RAY_prestart_worker_first_driver": "0"}
"""What a head that forks its workers adds to its environment: Ray starts no workers ahead
for its first driver. Those would carry a job id of their own (``ffffffff``) and so need
a zygote of their own, which costs what it saves a ``tally train`` of the demo: 54 CPU-s
with them, 45 without, 64 with no forking at all (three runs each, this machine)."""

def forking_on() -> bool:
    """Whether a head started from this process forks its workers: unless
    ``TALLY_FORK_WORKERS=0`` here."""
    return os.environ.get(ENABLE_ENV, "1") == "1"


def head_env(fork: bool) -> dict[str, str]:
    """What a head we start adds to its environment, forking its workers or not."""
    return {ENABLE_ENV: "1", **FORKING_HEAD_ENV} if fork else {ENABLE_ENV: "0"}


PRELOAD = ("torch", "transformers", "trainer.backends.fsdp.worker",
           "rollout.engines.torch_engine", "rollout.datasets", "rollout.engine_pool",
           "rollout.environments", "rollout.reward_parts", "rollout.rollouts",
           "rollout.teacher", "ray._private.node")
"""What a zygote imports before it serves: the modules of the actors a job starts most
(a policy rank, an engine, what the rollout manager imports). Not ``rollout.manager``
itself, nor any module that makes a Ray actor class when imported: ``ray.remote`` on a
class draws a random id, and a zygote must draw none (:func:`forks_draw_fresh_ids`). A
module that fails to import is left for the child to import (and report) itself."""

BASE_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor",
                "torch.distributed.checkpoint", "torch.distributed.fsdp", "transformers",
                "transformers.modeling_utils", "datasets", "safetensors.torch", "pydantic")
"""What a *base* zygote imports: the heavy third-party modules of every kind of worker
(about 85% of a worker's imports), none of which imports Ray or reads a variable of
:data:`KIND_ONLY_PREFIXES`. It forks the zygote of each kind, which imports Ray and
:data:`PRELOAD` on top in its own environment (1–1.5 CPU-s, against 8–10 for all)."""

KIND_ONLY_PREFIXES = ("RAY_", "TALLY_")
"""Variables that tell kinds of workers apart (a job's id and token, Ray's settings) but
that nothing in :data:`BASE_PRELOAD` reads: a base zygote is named by the environment
without them, and runs without them, so it holds no job's credentials."""

ZYGOTE_START_S = 40.0
"""How long a launcher waits for its zygote to listen before it runs its worker the
ordinary way (the zygote imports in about what one actor's start takes). Below Ray's
60 s for a started worker to register: a worker that waited longer would be given up."""

ZYGOTE_IDLE_S = 60.0
"""A zygote with no live child this long ends: its job is over (a job's actors live as
long as it does), and a restart or the next job of a process that runs several comes
well within it."""

SOCKET_PATH_MAX = 100
"""The longest unix socket path we bind (Linux allows 107 bytes)."""


def forked_worker_path() -> contextlib.AbstractContextManager[None]:
    """While a head starts in this process (``ray.init``, ``ray start``): its raylet
    starts each worker through this file (services/runtime/node_defaults.py: Ray has no
    option for the worker path)."""
    from services.runtime.node_defaults import node_defaults

    return node_defaults(worker_path=os.path.abspath(__file__))


def default_worker_path() -> str:
    """Ray's own worker script, found without importing Ray (the launcher stays light)."""
    for entry in sys.path:
        path = os.path.join(entry, "ray", "_private", "workers", "default_worker.py")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError("ray/_private/workers/default_worker.py is not on sys.path")


def _exec_default_worker(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-u", default_worker_path(), *argv])


def _arg(argv: list[str], name: str) -> str | None:
    prefix = f"--{name}="
    return next((a[len(prefix):] for a in argv if a.startswith(prefix)), None)


def zygote_socket(argv: list[str], env: dict[str, str], cwd: str) -> str | None:
    """The socket of the zygote that serves a worker of these arguments, environment and
    working directory: in the Ray session's ``sockets`` folder, named by the hash of what
    a zygote must share with its children; None where the path would be too long."""
    return _socket(argv, env, cwd, "tz")


def base_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of the base zygote that forks the zygote of a worker with ``env``."""
    return {k: v for k, v in env.items() if not k.startswith(KIND_ONLY_PREFIXES)}


def base_socket(argv: list[str], env: dict[str, str], cwd: str) -> str | None:
    """The socket of the base zygote for a worker of these arguments, environment and
    working directory: named as :func:`zygote_socket` by :func:`base_env`."""
    return _socket(argv, base_env(env), cwd, "tb")


def _socket(argv: list[str], env: dict[str, str], cwd: str, prefix: str) -> str | None:
    temp_dir, session = _arg(argv, "temp-dir"), _arg(argv, "session-name")
    if not temp_dir or not session:
        return None
    kind = json.dumps([sys.executable, cwd, sorted(env.items())]).encode()
    path = os.path.join(temp_dir, session, "sockets",
                        f"{prefix}-{hashlib.sha256(kind).hexdigest()[:16]}")
    return path if len(path) <= SOCKET_PATH_MAX else None


def _send(conn: socket.socket, payload: bytes, fds: list[int]) -> None:
    """One length-prefixed message, ``fds`` riding on its first bytes."""
    message = struct.pack("!I", len(payload)) + payload
    if fds:
        socket.send_fds(conn, [message], fds)
    else:
        conn.sendall(message)


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the other end closed")
        data += chunk
    return data


def _connect(path: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    return conn


def _wait_for(path: str, deadline: float) -> socket.socket | None:
    """A connection to the zygote of ``path`` once it listens; None if it has not by
    ``deadline``, or if it was started and died."""
    while (conn := _connect(path)) is None:
        if time.monotonic() >= deadline or _zygote_gone(path):
            return None
        time.sleep(0.05)
    return conn


def _lock_holder(path: str) -> int | None:
    """The pid of the zygote the lock beside ``path`` names; None while its starter has
    not written it yet, or where there is no lock."""
    try:
        with open(path + ".lock", encoding="ascii") as lock:
            return int(lock.read() or 0) or None
    except (OSError, ValueError):
        return None


def _zygote_gone(path: str) -> bool:
    """Whether the zygote of ``path`` was started and has died (killed, out of memory):
    its lock names a pid that no longer runs."""
    holder = _lock_holder(path)
    return holder is not None and not _alive(holder)


def _take_lock(path: str) -> int | None:
    """The exclusive lock beside ``path`` (its descriptor), unless another launcher holds
    it. A lock whose zygote died is cleared and taken over, so no launcher waits on it."""
    lock = path + ".lock"
    if _zygote_gone(path):
        for name in (path, lock):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
    try:
        return os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return None


def _popen_zygote(path: str, flag: str, env: dict[str, str] | None = None,
                  *extra: str) -> int:
    import subprocess

    log = os.path.join(os.path.dirname(os.path.dirname(path)), "logs",
                       f"tally-zygote-{os.getpid()}.err")
    with open(log, "ab") as err:
        zygote = subprocess.Popen(
            [sys.executable, "-u", os.path.abspath(__file__), flag, path, *extra],
            stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True,
            close_fds=True, env=env)
    return zygote.pid


def _start_zygote(path: str, argv: list[str] | None = None, deadline: float = 0.0) -> None:
    """Start the zygote for ``path`` unless another launcher already did (an exclusive
    lock file beside the socket holds its pid): forked by the base zygote of this
    launcher's environment (started if need be, waited for until ``deadline``), else a
    process of its own; either runs detached, with this launcher's environment."""
    held = _take_lock(path)
    if held is None:
        return
    env, cwd = dict(os.environ), os.getcwd()
    pid = _fork_from_base(path, argv, env, cwd, deadline) if argv is not None else None
    if pid is None:
        pid = _popen_zygote(path, "--zygote")
    os.write(held, str(pid).encode())
    os.close(held)


def _fork_from_base(path: str, argv: list[str], env: dict[str, str], cwd: str,
                    deadline: float) -> int | None:
    """The pid of the zygote for ``path`` that the base zygote of ``env`` forked; None
    where there is no base to ask in time."""
    base = base_socket(argv, env, cwd)
    if base is None:
        return None
    conn = _connect(base)
    if conn is None:
        held = _take_lock(base)
        if held is not None:
            raylet = env.get("RAY_RAYLET_PID", "0")  # not in a base's environment
            os.write(held, str(_popen_zygote(base, "--base", base_env(env), raylet)).encode())
            os.close(held)
        conn = _wait_for(base, deadline)
        if conn is None:
            return None
    with conn:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        try:
            _send(conn, json.dumps({"serve": path, "env": env, "cwd": cwd}).encode(), [])
            (pid,) = struct.unpack("!i", _recv_exact(conn, 4))
        except (OSError, ConnectionError):
            return None
    return pid if pid > 0 else None


def launch(argv: list[str]) -> None:
    """The launcher: run one Ray worker, forked by the zygote of its kind where one can
    serve it, else the ordinary way. Exits with the worker's exit code."""
    env, cwd = dict(os.environ), os.getcwd()
    path = zygote_socket(argv, env, cwd) if env.get(ENABLE_ENV) == "1" else None
    if path is None:
        _exec_default_worker(argv)
    conn = _connect(path)
    if conn is None:
        deadline = time.monotonic() + ZYGOTE_START_S
        _start_zygote(path, argv, deadline)
        conn = _wait_for(path, deadline)
        if conn is None:
            _exec_default_worker(argv)
    request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
    try:
        _send(conn, request, [0, 1, 2])
        (child,) = struct.unpack("!i", _recv_exact(conn, 4))
    except (OSError, ConnectionError):
        _exec_default_worker(argv)  # the zygote died before it forked: nothing started
    if child <= 0:  # a zygote that cannot fork safely (forks_draw_fresh_ids)
        _exec_default_worker(argv)

    def pass_on(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    try:
        (code,) = struct.unpack("!i", _recv_exact(conn, 4))
    except (OSError, ConnectionError):
        code = 1
    if code < 0:  # killed by a signal: die of the same one, as the worker did
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _run_child(conn: socket.socket, request: dict, fds: list[int],
               set_by_imports: dict[str, str]) -> None:
    """In the forked child: become the worker the launcher would have exec'd. Its
    environment is the launcher's, plus what the zygote's imports set in theirs (as the
    same imports in a fresh worker would)."""
    import runpy
    import threading

    os.setsid()  # its own process group, as a worker the raylet spawns: a group kill
    for target, fd in enumerate(fds):  # of it must not reach the zygote or its siblings
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update({**request["env"], **set_by_imports})
    os.chdir(request["cwd"])
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)

    def end_with_the_launcher() -> None:
        while conn.recv(1):
            pass
        os._exit(1)

    threading.Thread(target=end_with_the_launcher, daemon=True, name="launcher-watch").start()
    worker = default_worker_path()
    sys.argv = [worker, *request["argv"]]
    sys.path[0] = os.path.dirname(worker)
    code = 0
    try:
        runpy.run_path(worker, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _import_all(names: tuple[str, ...]) -> dict[str, str]:
    """Import ``names`` (one that fails is left for the child to import and report), then
    freeze what is alive (:func:`gc.freeze`); what the imports set in the environment.

    Frozen, the imported modules' objects are left out of every later garbage collection
    here and in the children: a full collection in a child (Ray's worker asks for one
    now and then, from its ``PythonGCThread``: 4.5 of 26 CPU-s sampled in a session's
    rank) walks only what the child made, not the ~435k objects of torch and
    transformers: 0.0002 CPU-s against 0.53 in a forked actor, and the pages it shares
    with this process stay unwritten."""
    import gc
    import importlib

    sys.path[0] = os.path.dirname(default_worker_path())  # the children's, not this folder
    environ_before = dict(os.environ)
    for name in names:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    gc.collect()  # garbage of the imports is freed, not frozen
    gc.freeze()
    return {k: v for k, v in os.environ.items() if environ_before.get(k) != v}


def _listen(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # launchers see the socket only once it listens
    listener.listen(64)
    return listener


def _receive(listener: socket.socket) -> tuple[socket.socket, dict, list[int]] | None:
    """One request: its connection, its message and the descriptors that came with it."""
    conn, _ = listener.accept()
    conn.settimeout(30)
    fds: list[int] = []
    try:
        # the descriptors ride on the first bytes: read those with them
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if len(data) < 4:
            data += _recv_exact(conn, 4 - len(data))
        size = struct.unpack("!I", data[:4])[0]
        payload = data[4:] + _recv_exact(conn, size - (len(data) - 4))
        request = json.loads(payload)
    except (OSError, ConnectionError, ValueError):
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    conn.settimeout(None)
    return conn, request, fds


Children = dict[int, "socket.socket | None"]
"""A zygote's live children: pid → the connection to tell the exit code on, or None."""

Handler = Callable[[socket.socket, socket.socket, dict, list[int], Children], None]
"""Serves one request (the listener, the request's connection, message and
descriptors, the live children); in a child it forks, it never returns."""


def _serve_requests(path: str, raylet: int, handle: Handler) -> None:
    """Listen on ``path`` and hand each request to ``handle`` until the raylet is gone
    or no child has lived for :data:`ZYGOTE_IDLE_S`; then remove the socket and lock."""
    listener = _listen(path)
    children: Children = {}
    idle_since = time.monotonic()
    try:
        while raylet == 0 or _alive(raylet):
            ready, _, _ = select.select([listener], [], [], 0.5)
            _reap(children)
            received = _receive(listener) if ready else None
            if received is not None:
                handle(listener, *received, children)
            if children:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > ZYGOTE_IDLE_S:
                break
    finally:
        listener.close()
        for name in (path, path + ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)


def serve_base(path: str, raylet: int) -> None:
    """The base zygote: import :data:`BASE_PRELOAD` (never Ray), listen on ``path``, and
    fork the zygote of each kind a launcher asks for, in that kind's environment and
    folder, answering its pid (0: this base imported Ray and forks none). Ends with
    the raylet, or once it has had no live zygote for :data:`ZYGOTE_IDLE_S`."""
    set_by_imports = _import_all(BASE_PRELOAD)
    safe = "ray" not in sys.modules  # a zygote must import Ray in its own environment
    if not safe:
        print("tally base zygote: an import brought in Ray; every zygote starts on its "
              "own", file=sys.stderr, flush=True)

    def fork_zygote(listener: socket.socket, conn: socket.socket, request: dict,
                    fds: list[int], zygotes: Children) -> None:
        for fd in fds:
            os.close(fd)
        pid = os.fork() if safe else 0
        if pid == 0 and safe:
            listener.close()
            conn.close()
            os.setsid()
            os.environ.clear()
            os.environ.update({**request["env"], **set_by_imports})
            os.chdir(request["cwd"])
            try:
                serve(request["serve"], set_by_imports)
            finally:
                os._exit(0)
        if pid:
            zygotes[pid] = None
        with contextlib.suppress(OSError):
            conn.sendall(struct.pack("!i", pid))
        conn.close()

    _serve_requests(path, raylet, fork_zygote)


def serve(path: str, inherited: dict[str, str] | None = None) -> None:
    """The zygote: import :data:`PRELOAD`, listen on ``path``, fork a worker per request,
    and tell each launcher its child's pid and, later, its exit code. ``inherited``:
    what the imports of the base zygote that forked it set in the environment."""
    set_by_imports = {**(inherited or {}), **_import_all(PRELOAD)}
    safe = forks_draw_fresh_ids()
    if not safe:
        print("tally zygote: children forked from it draw the same Ray ids (an import "
              "drew one); every worker runs the ordinary way", file=sys.stderr, flush=True)

    def fork_worker(listener: socket.socket, conn: socket.socket, request: dict,
                    fds: list[int], children: Children) -> None:
        if not safe:  # pid 0: the launcher runs its worker the ordinary way
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(struct.pack("!i", 0))
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in children.values():
                if other is not None:
                    other.close()
            _run_child(conn, request, fds, set_by_imports)
        for fd in fds:
            os.close(fd)
        children[pid] = conn
        with contextlib.suppress(OSError):
            conn.sendall(struct.pack("!i", pid))

    _serve_requests(path, int(os.environ.get("RAY_RAYLET_PID", "0")), fork_worker)


def forks_draw_fresh_ids() -> bool:
    """Whether two children forked from this process now draw different random Ray ids.

    Ray's C++ random generator (``ObjectID::FromRandom``, ``PlacementGroupID::Of``,
    ``ActorClassID`` of every ``ray.remote`` class) is one per process, seeded at its
    first draw. Once a zygote has drawn, every child forked from it draws the same
    sequence: two workers starting together then create the same object in the plasma
    store as it warms up, and one dies (``Check failed: WarmupStore() ... Seal() called
    on an object without a reference to it``) while the others wait on it."""
    from ray._raylet import ObjectID

    read, write = os.pipe()
    children = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.write(write, ObjectID.from_random().binary())
            os._exit(0)
        children.append(pid)
    os.close(write)
    for pid in children:
        os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as drawn:
        ids = drawn.read()
    size = len(ObjectID.nil().binary())
    return len(ids) == 2 * size and ids[:size] != ids[size:]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie does not (a zygote killed while the launcher that
    started it still runs stays one until that launcher ends)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            status = stat.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc to read: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return status[status.rfind(")") + 2:][:1] not in ("Z", "X")


def _reap(children: Children) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
            conn.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["--base"]:
        serve_base(sys.argv[2], int(sys.argv[3]))
    else:
        launch(sys.argv[1:])
