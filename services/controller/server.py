"""Run the controller with uvicorn: ``tally serve`` / ``python -m services.controller``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket

from services.controller.settings import Settings, check_bind


def serve(settings: Settings, log_level: str = "info", sock: socket.socket | None = None
          ) -> None:
    """Serve until interrupted; refuses a non-loopback bind without a token. ``sock``: a
    socket bound already (``--fd``: handed down by whoever started the controller, e.g. a
    test holding its port); its address replaces the settings' host and port."""
    import uvicorn

    from services.controller.app import create_app

    if sock is not None:
        host, port = sock.getsockname()[:2]
        settings = settings.model_copy(update={"host": host, "port": port})
    check_bind(settings)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=5)
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run
        uvicorn.Server(config).run(sockets=None if sock is None else [sock])


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
