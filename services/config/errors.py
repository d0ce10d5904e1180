"""What is wrong with a job config, said once per field: ConfigError of ConfigProblems (the
one ``Problem`` type of rollout/problems.py), and the rewriting of pydantic's errors into
them.

Pydantic's error locations hold steps that are no YAML key: a validator
(``function-after[...]``), the variant of a discriminated union (``rollout.dataset.jsonl``)
or of a plain union (``aggregation.divisor.float``). :func:`field_path` walks the schema
along a location and keeps only the keys a user writes, so every problem names a field
that exists. Two of pydantic's messages are rewritten to say what to write instead:

- an unknown key names the known key one edit away at that level, if there is one
  (``trainer.optimizer.lrr: unknown key; did you mean lr?``; one edit: an insertion, a
  deletion, a substitution or a swap of two neighbours, the Damerau-Levenshtein distance 1);
- a variant without ``type``, or with a ``type`` no variant has, is a problem of the
  ``type`` field and lists the values that exist (``rollout.dataset.type: missing; one of
  synthetic, jsonl, parquet, math_words, reasoning_gym``).

Imports only pydantic (and rollout/problems.py, standard library only).
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel, Tag, ValidationError

from rollout.problems import Problem

ConfigProblem = Problem
"""One thing wrong with a job config: the one Problem type (rollout/problems.py)."""


class ConfigError(ValueError):
    """A job config that cannot run; ``problems`` name the field (or the line) of each.

    ``source`` is where the config came from (a path, ``<config>``, ``--set key``), "" for a
    check of a config already validated. The text is ``text`` when given, else one line per
    problem: ``source: message``, or ``field: message`` without a source.
    """

    def __init__(self, source: str, problems: list[ConfigProblem],
                 text: str | None = None) -> None:
        self.source, self.problems = source, list(problems)
        if text is None:
            text = "\n".join(f"{source or p.field}: {p.message}" if source or p.field
                             else p.message for p in self.problems)
        super().__init__(text)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, list[ConfigProblem], str]]:
        return type(self), (self.source, self.problems, str(self))  # crosses Ray intact


def error_field(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """A pydantic error location as a dotted field path (``trainer.optimizer[0]``),
    without the ``function-…`` steps of validators; "" for the input itself. Knows no
    schema: :func:`field_path` also drops the union steps of one."""
    return ".".join(f"[{part}]" if isinstance(part, int) else str(part) for part in loc
                    if not str(part).startswith("function-")).replace(".[", "[")


def _alternatives(annotation: Any) -> list[tuple[set[str], Any]]:
    """The types a value of ``annotation`` may be, each with the names pydantic gives it in
    an error location: its Tag, its ``type`` values (a discriminated union), its class
    name (a plain union). A tagged member is one alternative even when it is a union."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *metadata = typing.get_args(annotation)
        tags = {m.tag for m in metadata if isinstance(m, Tag)}
        if tags:
            return [(tags, inner)]
        return _alternatives(inner)
    if origin in (Union, types.UnionType):
        return [alt for arg in typing.get_args(annotation) if arg is not type(None)
                for alt in _alternatives(arg)]
    names: set[str] = set()
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        names.add(annotation.__name__)
        kind = annotation.model_fields.get("type")
        if kind is not None and typing.get_origin(kind.annotation) is Literal:
            names.update(str(value) for value in typing.get_args(kind.annotation))
    return [(names, annotation)]


def variant_names(annotation: Any) -> list[str]:
    """The ``type`` values (or Tags) of a union's variants, in schema order."""
    names: list[str] = []
    for found, member in _alternatives(annotation):
        kind = (member.model_fields.get("type") if isinstance(member, type)
                and issubclass(member, BaseModel) else None)
        if kind is not None and typing.get_origin(kind.annotation) is Literal:
            names += [str(v) for v in typing.get_args(kind.annotation)]
        else:
            names += sorted(found - {getattr(member, "__name__", "")})
    return list(dict.fromkeys(names))


def _step(annotation: Any, part: int | str) -> Any:
    """The annotation one key (or index) below ``annotation``; None once unknown."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _step(typing.get_args(annotation)[0], part)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(str(part))
        return field.annotation if field is not None else None
    if origin in (list, tuple, set, frozenset) and isinstance(part, int):
        return typing.get_args(annotation)[0]
    if origin is dict:
        return typing.get_args(annotation)[1]
    return None


def field_path(root: type[BaseModel], loc: tuple[int | str, ...] | list[int | str]
               ) -> tuple[str, type[BaseModel] | None, Any]:
    """(the dotted path of the keys a user writes, the model holding its last key, the
    annotation found there) for an error location under ``root``."""
    kept: list[str] = []
    annotation: Any = root
    owner: type[BaseModel] | None = None
    for part in loc:
        if str(part).startswith("function-"):
            continue
        alternatives = _alternatives(annotation) if annotation is not None else []
        if len(alternatives) > 1:
            chosen = [member for names, member in alternatives if str(part) in names]
            fields = {name for _, member in alternatives if isinstance(member, type)
                      and issubclass(member, BaseModel) for name in member.model_fields}
            if chosen or (isinstance(part, str) and part not in fields):
                annotation = chosen[0] if chosen else None  # a union's step, no key
                continue
        if len(alternatives) == 1:
            annotation = alternatives[0][1]
        owner = (annotation if isinstance(annotation, type)
                 and issubclass(annotation, BaseModel) else None)
        annotation = _step(annotation, part) if annotation is not None else None
        kept.append(f"[{part}]" if isinstance(part, int) else str(part))
    return ".".join(kept).replace(".[", "["), owner, annotation


def one_edit_apart(a: str, b: str) -> bool:
    """Damerau-Levenshtein distance exactly 1: one insertion, deletion, substitution, or
    swap of two neighbouring characters."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                  and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def did_you_mean(word: str, known: typing.Iterable[str]) -> str:
    """``"; did you mean x?"`` (or ``x or y``) for the known words one edit from ``word``;
    "" when there is none."""
    close = [k for k in known if one_edit_apart(word.lower(), k.lower())]
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _rewritten(root: type[BaseModel], item: Any) -> ConfigProblem | None:
    """The problem of an unknown key or of a union's missing or unknown ``type``, said
    as the module says; None for any other error."""
    where, owner, annotation = field_path(root, item["loc"])
    kind, context = item["type"], item.get("ctx") or {}
    if kind == "extra_forbidden":
        key = where.rpartition(".")[2]
        return ConfigProblem(where, "unknown key" + did_you_mean(
            key, owner.model_fields if owner is not None else ()))
    discriminator = str(context.get("discriminator", ""))
    if kind in ("union_tag_not_found", "union_tag_invalid") and re.fullmatch(
            r"'\w+'", discriminator):
        field = f"{where}.{discriminator.strip(chr(39))}" if where else discriminator
        names = variant_names(annotation)
        listed = ", ".join(names)
        if kind == "union_tag_not_found":
            return ConfigProblem(field, f"missing; one of {listed}")
        tag = str(context.get("tag", ""))
        return ConfigProblem(field, f"{tag!r} is not one of {listed}{did_you_mean(tag, names)}")
    return None


def validation_error(err: ValidationError, source: str, root: type[BaseModel]) -> ConfigError:
    """One problem per pydantic error, each on the field a user writes (a section's rule
    adds its own field: the text keeps it after the section, ``  aggregation: divisor:
    ...``); a problem of the whole config is its message alone. One problem is one line,
    ``source: field: message``; several are listed under ``source: invalid job config``."""
    problems, lines = [], [f"{source}: invalid job config"]
    for item in err.errors():
        problem = _rewritten(root, item)
        if problem is None:
            where = field_path(root, item["loc"])[0]
            message = item["msg"].removeprefix("Value error, ")
            problem = ConfigProblem.from_rule(message, where)
            branch = where != error_field(item["loc"])  # one alternative of a plain union
            if branch and problems and problems[-1].field == problem.field:
                message = f"{problems[-1].message}; or {problem.message}"  # one problem
                problems[-1] = problem = ConfigProblem(problem.field, message)
                lines.pop()
                problems.pop()
        else:
            where, message = problem.field, problem.message
        problems.append(problem)
        lines.append(f"  {where}: {message}" if where else f"  {message}")
    if len(problems) == 1:  # one line that says what to fix, after where the config is
        return ConfigError(source, problems, f"{source}: {lines[1].strip()}")
    return ConfigError(source, problems, "\n".join(lines))
