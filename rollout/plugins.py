"""The one loader of ``module:attribute`` paths: a user's reward function or reducer, and
the built-in registries (engine classes, trainer backends) that import their class only
when it is used; and :func:`locate_object`, the check of such a path that imports nothing.

User code runs only in jobs: the controller checks a submitted path with
:func:`locate_object` (the module's file is found and parsed, never executed; a standard
library module is refused), the job's preflight imports it (:func:`check_object`).

It lives in ``rollout`` (the lowest package) so that ``trainer`` can share it; it imports
nothing but the standard library. Every error is one line that starts with the config
field holding the path and says how to fix it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MAX_NAMES_LISTED = 8
"""A module without the asked-for function: at most this many of its functions are named."""
MAX_SOURCE_BYTES = 4 * 1024 * 1024
"""A module file larger than this is located but not parsed (the job's import checks it):
the controller's work per submit stays bounded."""
NOT_ON_PATH = ("no module of that name on the Python path (put it in the job's working "
               "directory or on PYTHONPATH, e.g. PYTHONPATH=. tally train ...)")


class PluginError(ValueError):
    """A ``module:attribute`` path that does not name a callable; the message starts with
    the config field that holds the path."""


def _split(path: str, field: str) -> tuple[str, str]:
    module_name, sep, attr = path.partition(":")
    if not (sep and module_name and attr and attr.isidentifier()
            and all(part.isidentifier() for part in module_name.split("."))):
        raise PluginError(f"{field}: expected 'module:function', got {path!r}")
    if module_name.split(".")[0] in sys.stdlib_module_names:  # e.g. subprocess:Popen
        raise PluginError(f"{field}: {module_name!r} is a standard-library module, not "
                          "user code; name a function or class of your own module")
    return module_name, attr


def load_object(path: str, field: str) -> Any:
    """The callable ``path`` (``module:attribute``) names; errors start with ``field``."""
    module_name, attr = _split(path, field)
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


def load_subclass(path: str, field: str, base: type, where: str, must: str) -> type:
    """The class ``path`` names, imported (in the job only), which must subclass ``base``
    (an extension point's documented base class, importable from module ``where``); a
    PluginError starting with ``field`` otherwise, ending with ``must`` (what to write
    instead: "a policy loss must (class MyLoss(PolicyLoss), docs/extending.md)")."""
    found = load_object(path, field)
    if not (isinstance(found, type) and issubclass(found, base)):
        what = "a class" if isinstance(found, type) else f"a {type(found).__name__}"
        raise PluginError(f"{field}: {path} is {what} that does not subclass "
                          f"{where}.{base.__name__}; {must}")
    return found


def check_object(path: str, field: str) -> None:
    """:func:`load_object` as a check before anything starts (in the job, never the
    controller: it runs the module's code), leaving no trace: a module this call imported
    is dropped from ``sys.modules`` again, so a long-lived process sees the user's fixed
    module on the next check, not the one it cached."""
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
                f"{field}: cannot import module {module_name!r}: {NOT_ON_PATH}") from err
        missing = f"{err.name!r}, which is not installed here" if err.name else str(err)
        raise PluginError(f"{field}: cannot import module {module_name!r}: it needs "
                          f"{missing}") from err
    except Exception as err:  # a SyntaxError, or what the module raised while importing
        text = str(err).strip().splitlines()
        raise PluginError(f"{field}: cannot import module {module_name!r}: "
                          f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
                          ) from err


def locate_object(path: str, field: str, want_class: bool = False) -> None:
    """What can be known of ``path`` without running any of its code: its syntax, that
    the module's file is on the Python path (each package level found by
    ``PathFinder.find_spec``, which reads folders, never ``__init__`` code), that the file
    parses, that its top-level imports are installed and that it defines ``attr``
    (``want_class``: not as a function). The same one-line errors as the import."""
    module_name, attr = _split(path, field)
    spec = _find(module_name)
    if spec is None:
        raise PluginError(f"{field}: cannot import module {module_name!r}: {NOT_ON_PATH}")
    origin = Path(spec.origin) if spec.origin and spec.has_location else None
    if origin is None or origin.suffix != ".py" or not origin.is_file() or \
            origin.stat().st_size > MAX_SOURCE_BYTES:
        return  # a compiled or namespace module: the job's import checks it
    try:
        tree = ast.parse(origin.read_bytes(), filename=origin.name)
    except SyntaxError as err:
        raise PluginError(f"{field}: cannot import module {module_name!r}: SyntaxError: "
                          f"{err}") from None
    except (ValueError, RecursionError, MemoryError) as err:
        raise PluginError(f"{field}: cannot import module {module_name!r}: "
                          f"{type(err).__name__}") from None
    for needed in _top_level_imports(tree):
        if _find(needed) is None:
            raise PluginError(f"{field}: cannot import module {module_name!r}: it needs "
                              f"{needed!r}, which is not installed here")
    _check_defined(tree, module_name, attr, field, want_class)


def _find(module_name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of ``module_name`` with no code of it run: the top level by the import
    system's finders (installed, editable, on sys.path), each deeper level by PathFinder
    in its parent's folders (``importlib.util.find_spec`` would import the parents)."""
    parts = module_name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for depth in range(2, len(parts) + 1):
            if spec is None or not spec.submodule_search_locations:
                return None
            spec = importlib.machinery.PathFinder.find_spec(
                ".".join(parts[:depth]), list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return None
    return spec


def _top_level_imports(tree: ast.Module) -> list[str]:
    """Top-level packages the module imports unconditionally (not in a try, a function
    or an ``if``), in order; relative imports left out."""
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.append(node.module.split(".")[0])
    return list(dict.fromkeys(names))


def _module_level(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of the module's own scope: into ``if``/``try``/``with`` blocks, never
    into a function, class, lambda or comprehension (their names are not the module's)."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
                          | ast.Lambda | ast.ListComp | ast.SetComp | ast.DictComp
                          | ast.GeneratorExp):
            stack.extend(ast.iter_child_nodes(node))


def _check_defined(tree: ast.Module, module_name: str, attr: str, field: str,
                   want_class: bool) -> None:
    """``attr`` is bound at the module's top level (unless a star import or a module
    ``__getattr__`` could bind it); ``want_class``: not by a ``def``."""
    functions = {node.name: node for node in tree.body
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    bound = set(functions)
    for node in _module_level(tree.body):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.alias):
            if node.name == "*":
                return  # anything may come in
            bound.add(node.asname or node.name.split(".")[0])
    if attr not in bound and "__getattr__" not in bound:
        defined = sorted(name for name in functions if not name.startswith("_"))
        listed = ", ".join(defined[:MAX_NAMES_LISTED]) + (", …" if len(defined) >
                                                           MAX_NAMES_LISTED else "")
        raise PluginError(f"{field}: module {module_name!r} has no callable {attr!r} "
                          f"(it defines: {listed or 'no functions'})")
    if want_class and isinstance(functions.get(attr), ast.FunctionDef | ast.AsyncFunctionDef):
        raise PluginError(f"{field}: {module_name}:{attr} is a function; name a class that "
                          "subclasses rollout.environments.Environment")
