"""The one loader of ``module:attribute`` paths: a user's reward function or reducer, and
the built-in registries (engine classes, trainer backends) that import their class only
when it is used.

It lives in ``rollout`` (the lowest package) so that ``trainer`` can share it; it imports
nothing but the standard library. Every error is one line that starts with the config
field holding the path and says how to fix it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

MAX_NAMES_LISTED = 8
"""A module without the asked-for function: at most this many of its functions are named."""


class PluginError(ValueError):
    """A ``module:attribute`` path that does not name a callable; the message starts with
    the config field that holds the path."""


def load_object(path: str, field: str) -> Any:
    """The callable ``path`` (``module:attribute``) names; errors start with ``field``."""
    module_name, sep, attr = path.partition(":")
    if not (sep and module_name and attr):
        raise PluginError(f"{field}: expected 'module:function', got {path!r}")
    module = _import(module_name, field)
    obj = getattr(module, attr, None)
    if obj is None:
        defined = sorted(name for name, value in vars(module).items()
                         if callable(value) and not name.startswith("_")
                         and getattr(value, "__module__", None) == module.__name__)
        listed = ", ".join(defined[:MAX_NAMES_LISTED]) + (", …" if len(defined) >
                                                           MAX_NAMES_LISTED else "")
        raise PluginError(f"{field}: module {module_name!r} has no callable {attr!r} "
                          f"(it defines: {listed or 'no functions'})")
    if not callable(obj):
        raise PluginError(f"{field}: module {module_name!r} has no callable {attr!r} "
                          f"({attr!r} is a {type(obj).__name__})")
    return obj


def check_object(path: str, field: str) -> None:
    """:func:`load_object` as a check before anything starts, leaving no trace: a module
    this call imported is dropped from ``sys.modules`` again, so a long-lived process (the
    controller) sees the user's fixed module on the next check, not the one it cached."""
    module_name = path.partition(":")[0]
    imported_before = set(sys.modules)
    try:
        load_object(path, field)
    finally:
        parts = module_name.split(".")
        for depth in range(len(parts), 0, -1):  # the module and its new parent packages
            name = ".".join(parts[:depth])
            if name not in imported_before:
                sys.modules.pop(name, None)


def _import(module_name: str, field: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(f"{err.name}.")):
            raise PluginError(
                f"{field}: cannot import module {module_name!r}: no module of that name on "
                f"the Python path (put it in the job's working directory or on PYTHONPATH, "
                f"e.g. PYTHONPATH=. tally train ...)") from err
        missing = f"{err.name!r}, which is not installed here" if err.name else str(err)
        raise PluginError(f"{field}: cannot import module {module_name!r}: it needs "
                          f"{missing}") from err
    except Exception as err:  # a SyntaxError, or what the module raised while importing
        text = str(err).strip().splitlines()
        raise PluginError(f"{field}: cannot import module {module_name!r}: "
                          f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
                          ) from err
