"""Run the controller with uvicorn: ``tally serve`` / ``python -m services.controller``.

It prints ``Tally controller ready at <url>`` once its own ``/readyz`` says ready (the
database, the Ray job server with the cluster's resources, the static files): before that
line, a submit could be refused with 503 while an embedded Ray head is still coming up.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import httpx

from services.controller.settings import Settings, check_bind

READY_POLL_S = 0.1
SLOW_START_S = 60.0
"""After this long without being ready, say once what is missing."""


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not listening yet (uvicorn makes it listen):
    its port is known before the server starts, port 0 included."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port}: {err}") from None
    return sock


def local_url(host: str, port: int) -> str:
    """Where this machine reaches a server bound to ``host`` (a wildcard: loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def announce_when_ready(url: str, server: Any, out: Any = None) -> None:
    """Poll ``url``/readyz until it says ready, then print the URL (stops with the
    server)."""
    out = out or sys.stdout
    started, warned = time.monotonic(), False
    while not server.should_exit:
        detail = "it does not answer yet"
        try:
            answer = httpx.get(f"{url}/readyz", timeout=2)
            if answer.status_code == 200:
                print(f"Tally controller ready at {url}", file=out, flush=True)
                return
            detail = answer.json().get("detail", answer.text)
        except (httpx.HTTPError, ValueError):
            pass
        if not warned and time.monotonic() - started > SLOW_START_S:
            warned = True
            print(f"Tally controller at {url} is not ready yet: {detail}", file=sys.stderr,
                  flush=True)
        time.sleep(READY_POLL_S)


def serve(settings: Settings, log_level: str = "info", sock: socket.socket | None = None
          ) -> None:
    """Serve until interrupted; refuses a non-loopback bind without a token. ``sock``: a
    socket bound already (``--fd``: handed down by whoever started the controller, e.g. a
    test holding its port); its address replaces the settings' host and port."""
    # Offline by default: nothing the controller runs (preflight's reads of a model
    # folder included) may take a name for a Hugging Face hub id and fetch it. Set before
    # the app's imports: huggingface_hub reads it once, when first imported.
    os.environ["HF_HUB_OFFLINE"] = "1"
    import uvicorn

    from services.controller.app import create_app

    if sock is not None:
        host, port = sock.getsockname()[:2]
        settings = settings.model_copy(update={"host": host, "port": port})
    check_bind(settings)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if sock is None:
        sock = bound_socket(settings.host, settings.port)
    port = int(sock.getsockname()[1])
    app = create_app(settings.model_copy(update={"port": port}))
    config = uvicorn.Config(app, host=settings.host, port=port, log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    threading.Thread(target=announce_when_ready, args=(local_url(settings.host, port), server),
                     daemon=True, name="ready-announcer").start()
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run
        server.run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.controller")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--fd", type=int, default=None,
                        help="serve on this inherited, bound socket (not --host/--port)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    sock = None
    if args.fd is not None:
        sock = socket.socket(fileno=args.fd)
        sock.set_inheritable(False)  # never on to the processes the controller starts
    try:
        serve(Settings.from_env(host=args.host, port=args.port), args.log_level, sock)
    except ValueError as err:
        print(err)
        return 2
    return 0
