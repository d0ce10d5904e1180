"""A session's own process: ``python -m services.sessions.server <folder>``, a Ray job.

The controller submits it like a job (same Ray job server, same gang placement through
``reserve_job``), so the session outlives a controller killed mid-session, and a
restarted controller finds it again from ``<folder>/session.json``:

    {"state": "ready", "host": <node IP>, "port": …, "pid": …}        serving
    {"state": "ended", "reason": "idle" | "closed", "saved_path": …}  gone, state saved

It listens on its Ray node's IP (the controller may run on another pod or machine) and
gives that address, or ``TALLY_SESSIONS_ADVERTISE_HOST`` when set, in ``session.json``.
It answers only the controller: the bearer secret the controller wrote to ``.secret`` in
the folder (mode 0600; read and removed here as the server starts, never in the Ray job's
metadata: services/controller/session_secret.py). Calls run one at a time, in the order
they arrive. After ``TALLY_SESSION_IDLE_TIMEOUT_S`` without a call the session saves its
state as of its last ``optim_step`` (``save idle``: a Hugging Face folder and the trainer
state; gradients of calls no step followed are dropped) and ends.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from rollout.confined import Escapes, create_owned, read_inside
from rollout.problems import Problem, problems_body
from services.driver.run_dir import CONFIG_FILE  # a session's folder: a job's names
from services.sessions.replay import ReplayConflict, call_digest
from services.sessions.requests import ForwardBackward, OptimStep, Sample, Save
from services.sessions.runtime import SessionError, TrainingSession, session_roles

SESSION_FILE = "session.json"
SECRET_FILE = ".secret"
ADVERTISE_ENV = "TALLY_SESSIONS_ADVERTISE_HOST"
IDLE_ENV = "TALLY_SESSION_IDLE_TIMEOUT_S"


def write_state(folder: Path, state: dict[str, Any]) -> None:
    """``session.json``, replaced whole (a reader never sees half of it): staged in a new
    file (O_EXCL|O_NOFOLLOW, a fresh name) and renamed over it, so a link planted at either
    name is replaced, never written through (rollout/confined.py)."""
    staged = folder / f".{SESSION_FILE}.{secrets.token_hex(4)}.tmp"
    try:
        with os.fdopen(create_owned(staged, 0o644), "w", encoding="utf-8") as out:
            out.write(json.dumps(state))
        os.replace(staged, folder / SESSION_FILE)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def read_state(folder: Path) -> dict[str, Any] | None:
    """``session.json`` read without following a link (None for a link, a missing or an
    unreadable file)."""
    try:
        return json.loads(read_inside(folder, SESSION_FILE))
    except (OSError, ValueError):  # Escapes (a link) is a ValueError
        return None


def take_secret(folder: Path) -> str:
    """The controller's secret for this session, from ``<folder>/.secret`` (removed once
    read: the folder may be listed by others later), never read through a link."""
    path = folder / SECRET_FILE
    try:
        secret = read_inside(folder, SECRET_FILE).decode("utf-8", errors="replace").strip()
    except (OSError, Escapes) as err:
        raise SystemExit(f"session: no secret from the controller ({path}: {err})") from None
    path.unlink(missing_ok=True)
    if not secret:
        raise SystemExit(f"session: {path} is empty")
    return secret


def node_address() -> str:
    """The IP of the Ray node this process runs on, as the cluster knows it (the
    ``--node-ip-address`` it was started with: the address the controller reaches it at).
    Not ``ray.util.get_node_ip_address()``: in a driver that joined a cluster it guesses
    from the machine's interfaces, which may not be the node's address."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


def listen(node_ip: str, advertise: str | None) -> tuple[socket.socket, str]:
    """A socket bound (port 0) where the controller will call, and the host that
    ``session.json`` gives it. Without ``advertise``: the Ray node's IP, both. With an IP
    address this machine has (e.g. 127.0.0.1 where the controller runs beside its Ray
    head): that address, both; with a name (a Kubernetes Service) or an address of a NAT
    in front: bound on the node's IP, the name advertised."""
    for bind in ([advertise] if advertise and _is_ip(advertise) else []) + [node_ip]:
        sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
        try:
            sock.bind((bind, 0))
        except OSError:
            sock.close()
            if bind == node_ip:
                raise
            continue
        return sock, advertise or bind
    raise AssertionError("unreachable")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def field_of(loc: tuple[Any, ...]) -> str:
    """A pydantic location as the API names it: ``data[3].tokens``."""
    text = ""
    for part in loc:
        if part == "body":
            continue
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<body>"


def problems_response(status: int, problems: list[Problem], retriable: bool = False
                      ) -> JSONResponse:
    """``{"detail", "errors": [{"field", "message"}], "retriable"}``; ``retriable``: the
    call changed nothing, so the client may send it again with the same request_id."""
    return JSONResponse({**problems_body(problems), "retriable": retriable}, status)


def create_app(session: TrainingSession, secret: str, on_close: Any) -> FastAPI:
    app = FastAPI(title="Tally session", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def only_the_controller(request: Request, call_next: Any) -> Any:
        given = request.headers.get("authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(given.encode(), secret.encode()):
            return JSONResponse({"detail": "not the controller"}, 401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return problems_response(422, [Problem(field_of(tuple(e.get("loc", ()))),
                                               str(e.get("msg", ""))) for e in exc.errors()])

    @app.exception_handler(SessionError)
    async def refused(_request: Request, exc: SessionError) -> JSONResponse:
        return problems_response(exc.status, exc.problems, exc.retriable)

    @app.exception_handler(Exception)
    async def failed(_request: Request, exc: Exception) -> JSONResponse:
        # a trainer rank that died, a timeout: said in one line, the session's log has more
        print(f"session call failed: {type(exc).__name__}: {exc}", flush=True)
        return JSONResponse({"detail": f"{type(exc).__name__}: {exc}"}, 500)

    def run(name: str, verb: Any, body: BaseModel, *args: Any) -> Any:
        """One call under the session's lock; a ``request_id`` seen before gets its first
        answer (services/sessions/replay.py), looked up inside the lock so a retry waits
        for a first call still running."""
        request_id = getattr(body, "request_id", None)
        digest = call_digest(name, body) if request_id else ""
        with session.lock:
            if request_id:
                try:
                    if (answer := session.recent.lookup(request_id, digest)) is not None:
                        return answer
                except ReplayConflict as err:
                    raise SessionError(409, [Problem("request_id", str(err))]) from None
            if session.ended:  # idle or closed while this call waited for the lock
                raise SessionError(409, [Problem("session", f"ended ({session.ended})")])
            session.last_call = time.monotonic()
            try:
                answer = verb(*args)
            finally:
                session.last_call = time.monotonic()
            if request_id:
                session.recent.record(request_id, digest, answer)
            return answer

    @app.post("/forward_backward")
    def forward_backward(body: ForwardBackward) -> dict[str, Any]:
        return run("forward_backward", session.forward_backward, body, body)

    @app.post("/forward")
    def forward(body: ForwardBackward) -> dict[str, Any]:
        return run("forward", session.forward, body, body)

    @app.post("/optim_step")
    def optim_step(body: OptimStep) -> dict[str, Any]:
        return run("optim_step", session.optim_step, body, body)

    @app.post("/sample")
    def sample(body: Sample) -> dict[str, Any]:
        return run("sample", session.sample, body, body)

    @app.post("/save")
    def save(body: Save) -> dict[str, Any]:
        return run("save", session.save, body, body.name)

    @app.post("/load")
    def load(body: Save) -> dict[str, Any]:
        return run("load", session.load, body, body.name)

    @app.get("/state")
    def state() -> dict[str, Any]:
        return {**session.state(), "idle_s": time.monotonic() - session.last_call}

    @app.post("/close")
    def close() -> dict[str, Any]:
        with session.lock:
            on_close("closed", None)
            return {"state": "ended"}

    return app


def serve(folder: Path) -> int:
    import uvicorn

    from services.config.job import JobConfig
    from services.driver.job import job_model_path, with_threads
    from services.runtime.gang import Gang, ensure_ray

    config = JobConfig.model_validate_json(read_inside(folder, CONFIG_FILE))
    secret = take_secret(folder)
    idle_timeout_s = float(os.environ.get(IDLE_ENV, "1800"))
    ensure_ray(num_cpus=os.cpu_count() or 1)
    model_path = job_model_path(config)
    config = with_threads(config, model_path)
    write_state(folder, {"state": "starting", "pid": os.getpid()})
    gang = Gang(config, model_path, session_roles(config, model_path, folder))
    try:
        session = TrainingSession(gang, folder)
    except BaseException:
        gang.close()
        raise
    listener, host = listen(node_address(), os.environ.get(ADVERTISE_ENV) or None)
    listener.listen(128)  # before "ready" is written: an early call waits in the backlog
    server: uvicorn.Server | None = None
    ended: dict[str, Any] = {}

    def end(reason: str, saved_path: str | None) -> None:
        session.ended = reason
        ended.update({"state": "ended", "reason": reason, "saved_path": saved_path,
                      "step": session.step})
        write_state(folder, ended)  # said at once; the actors stop after
        if server is not None:
            server.should_exit = True

    def watch_idle() -> None:
        while not ended:
            time.sleep(min(1.0, idle_timeout_s / 4))
            if time.monotonic() - session.last_call < idle_timeout_s:
                continue
            with session.lock:
                if time.monotonic() - session.last_call < idle_timeout_s or ended:
                    continue
                if session.pending.calls:  # a step never taken: its gradients go
                    print(f"session idle with {session.pending.calls} forward_backward "
                          "call(s) pending: dropped (no optim_step followed)", flush=True)
                    session.drop_pending()
                try:
                    saved = session.save("idle")["path"]
                except Exception as err:  # the session still ends: it was left alone
                    saved = None
                    print(f"session idle: its state could not be saved "
                          f"({type(err).__name__}: {err})", flush=True)
                print(f"session idle for {idle_timeout_s:g} s: state saved at {saved}; "
                      "ending", flush=True)
                end("idle", saved)

    app = create_app(session, secret, end)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    port = listener.getsockname()[1]
    write_state(folder, {"state": "ready", "host": host, "port": port, "pid": os.getpid()})
    print(f"session ready: step {session.step}, {config.trainer.world_size} trainer rank(s), "
          f"model {config.rollout.model}", flush=True)
    threading.Thread(target=watch_idle, daemon=True).start()
    try:
        server.run(sockets=[listener])
    finally:
        session.close()
        write_state(folder, ended or {"state": "ended", "reason": "stopped",
                                      "saved_path": None, "step": session.step})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m services.sessions.server <session folder>", file=sys.stderr)
        return 2
    return serve(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())
