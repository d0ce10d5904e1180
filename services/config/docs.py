"""docs/configuration.md, generated from the JobConfig schema (one source of truth):
``tally schema --markdown > docs/configuration.md``."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel

from services.config.job import JobConfig

HEADER = """# Job configuration reference

Generated from the pydantic schema by `tally schema --markdown`; do not edit by hand.
Every field below is a YAML key of a job config (`configs/demo.yaml` shows them in use);
nested sections are written `a.b.c`. Unknown keys are errors that name the key.
"""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return annotation.__name__
    if origin is list:  # the items' own limits go to the limits column
        return f"list[{_type_name(typing.get_args(annotation)[0])}]"
    return str(annotation).replace("typing.", "")


def _bounds(metadata: list[Any]) -> list[str]:
    parts = []
    for meta in metadata:
        for name, symbol in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            value = getattr(meta, name, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    return parts


def _limits(field: Any) -> str:
    parts = _bounds(field.metadata)
    annotation = field.annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):  # list[...] | None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        item = typing.get_args(annotation)[0]
        if typing.get_origin(item) is typing.Annotated:
            item_metadata = [m for a in typing.get_args(item)[1:]
                             for m in getattr(a, "metadata", [a])]
            parts += [f"each {b}" for b in _bounds(item_metadata)]
    return ", ".join(parts)


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    title = f"`{prefix}`" if prefix else "job (top level)"
    out += [f"\n## {title} — {model.__name__}\n", (model.__doc__ or "").strip().splitlines()[0],
            "", "| key | type | default | limits | meaning |", "|---|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        if field.is_required():
            default = "required"
        elif _models_in(field.annotation):
            default = "(section)"
        else:
            default = f"`{field.get_default(call_default_factory=True)!r}`"
        description = (field.description or "").replace("\n", " ").replace("|", "\\|")
        out.append(f"| `{name}` | {_type_name(field.annotation)} | {default} | "
                   f"{_limits(field)} | {description} |")
        nested += [(f"{prefix}.{name}" if prefix else name, m) for m in _models_in(
            field.annotation)]
    for path, sub in nested:
        _section(sub, path, out)


def configuration_markdown() -> str:
    out = [HEADER]
    _section(JobConfig, "", out)
    return "\n".join(out) + "\n"
