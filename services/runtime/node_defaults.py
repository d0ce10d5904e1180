"""Settings of a Ray node that ``ray.init`` and ``ray start`` have no option for, given
to a head this process starts: the defaults Ray's node fills in for what its caller left
unset (``RayParams.update_if_absent``) take our values while the head starts. Used for
the worker path (services/runtime/forked_workers.py) and the log monitor
(services/runtime/gang.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def node_defaults(**ours: Any) -> Iterator[None]:
    """While a Ray node starts in this process: where Ray fills in a default named in
    ``ours``, it takes our value instead. Nested blocks each add theirs."""
    from ray._private import parameter

    fill_in = parameter.RayParams.update_if_absent

    def with_ours(params: Any, **defaults: Any) -> None:
        fill_in(params, **{name: ours.get(name, value) for name, value in defaults.items()})

    parameter.RayParams.update_if_absent = with_ours
    try:
        yield
    finally:
        parameter.RayParams.update_if_absent = fill_in
