"""From a submitted config to the exact config a job runs, or a 422 naming the field.

Bounded parsing, each step cheap before the next runs: a config over ``MAX_CONFIG_BYTES``
is refused (413) before any parser sees it; its nesting depth is measured by a linear scan
(over ``MAX_DEPTH``: 422); anchors and aliases are refused (a few lines of aliases can
expand to gigabytes); then PyYAML's C safe loader reads it, once per submission (a sweep
validates each run from the same parsed data). Every field the schema marks as a path
(rollout/config_paths.py) must resolve inside the allowed roots (the data folder plus
``TALLY_ALLOWED_ROOTS``), so a path field added later is confined without being listed
here; relative paths are taken from the data folder and written back absolute.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollout.config_paths import marked_paths
from rollout.pretrained import BUILTIN_MODELS
from rollout.problems import Problem
from services.config.errors import validation_error
from services.config.job import ConfigError, JobConfig, apply_override, job_mapping, load_yaml
from services.controller.settings import Settings
from services.runtime.preflight import preflight

MAX_CONFIG_BYTES = 64 * 1024
"""A job config (YAML text or JSON object) larger than this is refused with 413."""
MAX_DEPTH = 32
"""Deepest nesting of sections, lists and flow brackets a config may have."""


WHOLE_CONFIG = "<config>"
"""The ``field`` of a problem with the whole config (YAML syntax, not a mapping, empty)."""


class SubmissionError(ValueError):
    """An invalid submission (422): ``problems`` name each field; ``detail`` says them in
    a line (``field: message`` for one)."""

    def __init__(self, detail: str, problems: list[Problem] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.problems = problems or []

    @classmethod
    def of(cls, *problems: Problem) -> SubmissionError:
        """Refused for ``problems``, said on one line (``a: x; b: y``)."""
        return cls("; ".join(str(p) for p in problems), list(problems))


class ConfigTooLarge(SubmissionError):
    """The config is over MAX_CONFIG_BYTES (413)."""


@dataclass(frozen=True)
class Resolved:
    config: JobConfig
    """The validated config, paths resolved, output_dir set."""
    file_config: dict[str, Any]
    """What the job's config file holds (explicitly set fields only, re-parseable)."""
    output_dir: Path
    submitted_text: str
    overrides: list[str] = field(default_factory=list)


def from_config_error(err: ConfigError) -> SubmissionError:
    """ConfigError's problems, a problem of the whole input (YAML syntax, not a mapping,
    empty) named ``<config>``. One problem is one line of detail, as ``tally train`` says
    it: ``field: message``."""
    problems = [Problem(p.field or WHOLE_CONFIG, p.message) for p in err.problems]
    return SubmissionError(str(problems[0]) if len(problems) == 1 else str(err), problems)


def job_config_error(err: ValidationError, source: str) -> SubmissionError:
    """Pydantic's errors of a job config, each on the field a user writes."""
    return from_config_error(validation_error(err, source, JobConfig))


def _config_problem(message: str) -> SubmissionError:
    return SubmissionError.of(Problem(WHOLE_CONFIG, message))


def text_depth(text: str) -> int:
    """How deep ``text`` nests: block indentation levels (and ``- `` markers) plus open
    flow brackets, in one pass; quoted scalars and comments do not count. An estimate
    that needs no parser: it only has to tell a config from a bomb."""
    indents: list[int] = []
    deepest = flow = 0
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        if not stripped or stripped[0] == "#":
            continue
        if flow == 0:
            indent = len(line) - len(stripped)
            while indents and indents[-1] >= indent:
                indents.pop()
            indents.append(indent)
        block = len(indents) + (len(stripped) - len(stripped.lstrip("- ")) + 1) // 2
        quote, previous = "", " "
        for char in stripped:
            if quote:
                quote = "" if char == quote else quote
            elif char in "\"'" and previous in " \t[{,:":
                quote = char
            elif char == "#" and previous in " \t":
                break
            elif char in "[{":
                flow += 1
                deepest = max(deepest, block + flow)
            elif char in "]}":
                flow = max(0, flow - 1)
            previous = char
        deepest = max(deepest, block + flow)
    return deepest


def data_depth(data: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of parsed data (iterative; stops looking past ``limit``)."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict | list) and depth <= limit + 1:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1)
                        for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def load_config_text(text: str) -> dict[str, Any]:
    """YAML (or JSON) text -> a mapping, bounded as the module says; SubmissionError
    (ConfigTooLarge for the size) on any problem."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_CONFIG_BYTES:
        raise ConfigTooLarge(f"the job config is {size} bytes; at most {MAX_CONFIG_BYTES}")
    if text_depth(text) > MAX_DEPTH:
        raise _config_problem(f"nested deeper than {MAX_DEPTH} levels")
    try:
        data = load_yaml(text, "<config>", aliases=False)
    except ConfigError as err:
        raise from_config_error(err) from None
    try:
        data = job_mapping(data if text.strip() else None, "<config>")
    except ConfigError as err:  # nothing at all, or not a mapping
        raise from_config_error(err) from None
    if data_depth(data) > MAX_DEPTH:  # e.g. a long "- - - -" line
        raise _config_problem(f"nested deeper than {MAX_DEPTH} levels")
    return data


def load_config_object(config: dict[str, Any]) -> dict[str, Any]:
    """A JSON object config, bounded like a text one."""
    if data_depth(config) > MAX_DEPTH:
        raise _config_problem(f"nested deeper than {MAX_DEPTH} levels")
    size = len(json.dumps(config, separators=(",", ":")).encode())
    if size > MAX_CONFIG_BYTES:
        raise ConfigTooLarge(f"the job config is {size} bytes; at most {MAX_CONFIG_BYTES}")
    return config


def submitted_config(config: dict[str, Any] | None, config_yaml: str | None
                     ) -> tuple[dict[str, Any], str]:
    """(parsed config, text to store as submitted), bounded; a JSON object is stored as
    JSON."""
    if config_yaml is not None:
        return load_config_text(config_yaml), config_yaml
    config = load_config_object(config or {})
    return config, json.dumps(config, indent=2)


def config_from_data(data: dict[str, Any], overrides: list[str],
                     source: str = "<config>") -> JobConfig:
    """Parsed config + ``key=value`` overrides -> a validated JobConfig (``data`` itself
    is left as it is: a sweep builds every run from the same data)."""
    data = copy.deepcopy(data)
    try:
        for override in overrides:
            apply_override(data, override)
        return JobConfig.model_validate(data)
    except ConfigError as err:
        raise from_config_error(err) from None
    except ValidationError as err:
        raise job_config_error(err, source) from None
    except (ValueError, TypeError, RecursionError) as err:
        raise _config_problem(str(err)) from None


def _refuse(field_path: str, message: str) -> SubmissionError:
    return SubmissionError.of(Problem(field_path, message))


def _inside_roots(value: str, field_path: str, settings: Settings) -> Path:
    """``value`` resolved (a relative one from the data folder); refused naming the
    allowed roots only: what the folder holds is never said (it may be anyone's)."""
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else settings.data_dir / path).resolve()
    if not any(path.is_relative_to(root) for root in settings.roots):
        roots = ", ".join(str(r) for r in settings.roots)
        raise _refuse(field_path, f"{value} is outside the allowed roots ({roots}); move it "
                      f"into one, or start the controller with its folder in "
                      f"TALLY_ALLOWED_ROOTS ('{os.pathsep}'-separated)")
    return path


def _not_local(field_path: str, kind: str, value: str) -> SubmissionError:
    """A model or folder that is not there: refused here, since anything past this point
    could take ``org/name`` for a Hugging Face hub id (the controller is offline)."""
    if kind == "model":
        return _refuse(field_path, f"{value!r} is neither a built-in model nor a local "
                       f"folder; built-in models: {', '.join(BUILTIN_MODELS)}; or name a "
                       "Hugging Face model folder inside the allowed roots (Tally does not "
                       "download models)")
    return _refuse(field_path, f"{value!r} is not a local folder inside the allowed roots "
                   "(Tally does not download models or tokenizers)")


def _set_field(data: dict[str, Any], field_path: str, value: str) -> None:
    """``data`` at ``rollout.reward[1].path`` (marked_paths' spelling) = ``value``."""
    node: Any = data
    *parents, leaf = re.split(r"\.|(?=\[)", field_path)
    for part in parents:
        node = node[int(part[1:-1])] if part.startswith("[") else node.setdefault(part, {})
    node[leaf] = value


def resolve_paths(config: JobConfig, data: dict[str, Any], settings: Settings,
                  default_output: Path) -> Path:
    """Every field the schema marks as a path (rollout/config_paths.py) must resolve
    inside the allowed roots; resolved ones are written into ``data``. A model or folder
    that is read must exist (a built-in model name aside): a name that is no folder here
    is refused, never looked up. Returns the job folder. Whether each reads is the
    preflight's (the same one-line messages as ``tally train``)."""
    for field_path, kind, value in marked_paths(config):
        if field_path == "output_dir" or (kind == "model" and value in BUILTIN_MODELS):
            continue
        path = _inside_roots(value, field_path, settings)
        if kind in ("model", "folder") and not path.is_dir():
            raise _not_local(field_path, kind, value)
        _set_field(data, field_path, str(path))
    output_dir = (_inside_roots(config.output_dir, "output_dir", settings)
                  if config.output_dir else default_output)
    data["output_dir"] = str(output_dir)
    return output_dir


def check_output_dir(path: Path, value: str, settings: Settings,
                     taken: Sequence[str]) -> None:
    """A job's own folder: never the data folder or an allowed root (or one holding
    them: deleting the job's folder would delete them), the model or warm-up caches, the
    controller's job or session folders, nor a folder of another job (or one inside or
    around it)."""
    data = settings.data_dir.expanduser().resolve()

    def refuse(why: str) -> None:
        message = f"{value} {why}; leave output_dir unset and the job writes to its own " \
                  f"{settings.jobs_dir}/<id>"
        raise SubmissionError.of(Problem("output_dir", message))

    if data.is_relative_to(path):
        refuse("is the data folder, or holds it")
    for root in settings.roots:
        if root.is_relative_to(path):
            refuse(f"is an allowed root ({root}), or holds one")
    for folder, what in ((data / "models", "the model cache"),
                         (data / "warmup", "the warm-up cache"),
                         (data / "jobs", "the controller's job folders"),
                         (data / "sessions", "the controller's session folders")):
        if path.is_relative_to(folder):
            refuse(f"is inside {what} ({folder})")
    for other in taken:
        folder = Path(other).expanduser().resolve()
        if path.is_relative_to(folder) or folder.is_relative_to(path):
            refuse(f"overlaps the folder of another job ({folder})")


def check_runnable(config: JobConfig) -> None:
    """What pydantic cannot see (packages, paths): the driver's own preflight."""
    try:
        preflight(config)
    except ConfigError as err:
        raise from_config_error(err) from None


def resolve(data: dict[str, Any], overrides: list[str], settings: Settings, job_id: str,
            stored_text: str, source: str = "<config>", output_suffix: str | None = None,
            taken: Sequence[str] = ()) -> Resolved:
    """Validate a submission (parsed once by :func:`submitted_config`); raises
    SubmissionError (-> 422) before anything is stored. ``taken``: the folders of the
    jobs already stored."""
    config = config_from_data(data, overrides, source)
    data = config.model_dump(mode="json", exclude_unset=True)
    output_dir = resolve_paths(config, data, settings, settings.jobs_dir / job_id)
    if config.output_dir:  # a sweep's runs go to <output_dir>/<job id>: both are checked
        check_output_dir(output_dir, config.output_dir, settings, taken)
        if output_suffix:
            output_dir = output_dir / output_suffix
            data["output_dir"] = str(output_dir)
            check_output_dir(output_dir, config.output_dir, settings, taken)
    try:
        final = JobConfig.model_validate(data)
    except ValidationError as err:  # a resolved path broke a rule: report, never 500
        raise job_config_error(err, source) from None
    check_runnable(final)  # after path resolution: paths are checked where they will be read
    return Resolved(final, data, output_dir, stored_text, list(overrides))
