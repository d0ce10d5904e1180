"""Which config fields name a file or folder: marked in the schema, found by walking.

A field that names a path carries ``json_schema_extra={PATH_KEY: kind}`` (spelled
:data:`MODEL`, :data:`FOLDER`, :data:`FILE` or :data:`OUTPUT`). The controller confines
every marked field by walking a validated config (:func:`marked_paths`), so a path field
added later is confined without anyone remembering a list. The mark is plain pydantic
metadata, so trainer/config.py writes the same dict without importing this module (the
trainer imports nothing of rollout's but its wire formats). Imports only pydantic.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, get_args

from pydantic import BaseModel
from pydantic.fields import FieldInfo

PATH_KEY = "x-tally-path"
"""The json_schema_extra key of a path field (also seen in configs/tally.schema.json)."""
PathKind = Literal["model", "folder", "file", "output"]
"""model: a built-in model name or a model folder (read); folder / file: read only;
output: a folder the job writes."""
PATH_KINDS: tuple[str, ...] = get_args(PathKind)

MODEL: dict[str, Any] = {PATH_KEY: "model"}
FOLDER: dict[str, Any] = {PATH_KEY: "folder"}
FILE: dict[str, Any] = {PATH_KEY: "file"}
OUTPUT: dict[str, Any] = {PATH_KEY: "output"}


def path_kind(info: FieldInfo) -> str | None:
    """The kind a field is marked with, or None; an unknown kind is a schema bug."""
    extra = info.json_schema_extra
    kind = extra.get(PATH_KEY) if isinstance(extra, dict) else None
    if kind is not None and kind not in PATH_KINDS:
        raise TypeError(f"{PATH_KEY}: {kind!r} is not one of {', '.join(PATH_KINDS)}")
    return None if kind is None else str(kind)


def marked_paths(config: BaseModel, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(dotted field path, kind, value) of every marked field holding a string, through
    nested models, lists, tuples and dicts (a union is walked as the variant it holds).
    Paths read ``rollout.reward[1].path``, as preflight and the 422s name fields."""
    for name, info in type(config).model_fields.items():
        yield from _walk(getattr(config, name), f"{prefix}{name}", path_kind(info))


def _walk(value: object, where: str, kind: str | None) -> Iterator[tuple[str, str, str]]:
    if isinstance(value, BaseModel):
        yield from marked_paths(value, f"{where}.")
    elif isinstance(value, str):
        if kind is not None:
            yield where, kind, value
    elif isinstance(value, list | tuple):
        for k, item in enumerate(value):
            yield from _walk(item, f"{where}[{k}]", kind)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{where}.{key}", kind)
