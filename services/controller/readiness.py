"""Live and ready, told apart.

``GET /healthz`` (live): the process serves HTTP. It is an async route that reads only
what is in memory, so it answers while every worker thread is busy (a probe that kills a
controller whose threads wait on Ray would make things worse).

``GET /readyz`` (ready): the controller can take work now: its database answers, the Ray
job server answers and reports the cluster's resources (what admission needs: right after
a head starts it answers before its nodes report, and a submit then would be a 503), and
its dashboard's static files are there. :func:`watch` re-checks in the background (every
``FAST_S`` until ready, then every ``SLOW_S``), so neither route waits on a check.
``tally serve`` prints its URL once ``/readyz`` says ready (services/controller/server.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import BaseModel

from services.controller.ray_jobs import BackendUnavailable
from services.controller.state import Controller

FAST_S = 0.25
SLOW_S = 2.0


class Ready(BaseModel):
    ready: bool
    database: bool
    ray: bool
    """The Ray job server answered and reported the cluster's resources."""
    static: bool
    detail: str
    """What is not ready yet ("" when ready)."""


NOT_CHECKED = Ready(ready=False, database=False, ray=False, static=False,
                    detail="not checked yet")


def check(ctl: Controller, static: Path) -> Ready:
    """Every check once (blocking; each bounded by the database's and Ray's timeouts)."""
    problems = []
    database = ctl.store.ping()
    if not database:
        problems.append("database: does not answer")
    ray = False
    if ctl.reconciler is None:
        problems.append("ray: the controller is still starting its Ray head")
    else:
        try:
            ctl.reconciler.backend.resources()  # None (Ray does not say) is ready too
            ray = True
        except BackendUnavailable as err:
            problems.append(f"ray: {err}")
        except Exception as err:  # a check never kills the watcher
            problems.append(f"ray: {type(err).__name__}: {err}")
    files = (static / "index.html").is_file()
    if not files:
        problems.append(f"static: {static / 'index.html'} is missing")
    return Ready(ready=not problems, database=database, ray=ray, static=files,
                 detail="; ".join(problems))


async def watch(ctl: Controller, static: Path) -> None:
    """Keep ``ctl.readiness`` current (cancelled at shutdown)."""
    while True:
        ctl.readiness = await asyncio.to_thread(check, ctl, static)
        await asyncio.sleep(SLOW_S if ctl.readiness.ready else FAST_S)
