"""Ray's ``ray`` command, with the raylet of a head it starts forking its workers
(services/runtime/forked_workers.py): the controller's embedded head runs
``python -m services.runtime.ray_start start --head ...`` in place of ``ray start``.
``ray start`` has no option for the worker path; :func:`forked_worker_path` swaps it in
while the node starts. Whether its launchers fork is the head environment's
``TALLY_FORK_WORKERS``, as on every head we start."""

from __future__ import annotations

import sys

from ray.scripts.scripts import main

from services.runtime.forked_workers import forked_worker_path

if __name__ == "__main__":
    with forked_worker_path():
        sys.exit(main())
