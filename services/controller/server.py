"""Run the controller with uvicorn: ``tally serve`` / ``python -m services.controller``."""

from __future__ import annotations

import argparse
import logging

from services.controller.settings import Settings, check_bind


def serve(settings: Settings, log_level: str = "info") -> None:
    """Serve until interrupted; refuses a non-loopback bind without a token."""
    import uvicorn

    from services.controller.app import create_app

    check_bind(settings)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level,
                access_log=False, timeout_graceful_shutdown=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.controller")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    try:
        serve(Settings.from_env(host=args.host, port=args.port), args.log_level)
    except ValueError as err:
        print(err)
        return 2
    return 0
