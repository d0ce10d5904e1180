"""The one loader of ``module:attribute`` paths: a user's reward function or reducer, and
the built-in registries (engine classes, trainer backends) that import their class only
when it is used.

It lives in ``rollout`` (the lowest package) so that ``trainer`` can share it; it imports
nothing but the standard library.
"""

from __future__ import annotations

import importlib
from typing import Any


class PluginError(ValueError):
    """A ``module:attribute`` path that does not name a callable; the message starts with
    the config field that holds the path."""


def load_object(path: str, field: str) -> Any:
    """The callable ``path`` (``module:attribute``) names; errors start with ``field``."""
    module_name, sep, attr = path.partition(":")
    if not (sep and module_name and attr):
        raise PluginError(f"{field}: expected 'module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PluginError(f"{field}: cannot import module {module_name!r}: {err}") from err
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise PluginError(f"{field}: module {module_name!r} has no callable {attr!r}")
    return obj
