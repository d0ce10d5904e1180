"""From a submitted config to the exact config a job runs, or a 422 naming the field.

Safety: YAML is read with PyYAML's safe loader (``parse_job_config``) and anchors/aliases
are refused (a few lines of aliases can expand to gigabytes); every path in the config
must resolve inside the allowed roots (the data folder plus ``TALLY_ALLOWED_ROOTS``);
relative paths are taken from the data folder and written back absolute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from services.config import ConfigError, JobConfig, parse_job_config
from services.controller.settings import Settings
from services.preflight import preflight


class SubmissionError(ValueError):
    """An invalid submission; ``errors`` holds (field path, message) pairs."""

    def __init__(self, detail: str, errors: list[tuple[str, str]] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = errors or []


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
    """ConfigError's problems -> (field path, message) pairs; a problem of the whole input
    (YAML syntax, not a mapping) is ``<config>``'s."""
    return SubmissionError(str(err), [(p.field or "<config>", p.message) for p in err.problems])


def refuse_yaml_aliases(text: str) -> None:
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, yaml.AliasToken | yaml.AnchorToken):
                raise SubmissionError("YAML anchors and aliases are not accepted",
                                      [("<config>", "YAML anchors and aliases are not accepted")])
    except yaml.YAMLError:
        return  # parse_job_config reports the line and column


def _inside_roots(value: str, field_path: str, settings: Settings) -> Path:
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else settings.data_dir / path).resolve()
    if not any(path.is_relative_to(root) for root in settings.roots):
        roots = ", ".join(str(r) for r in settings.roots)
        raise SubmissionError(f"{field_path}: {value} is outside the allowed roots ({roots})",
                              [(field_path, f"{value} is outside the allowed roots ({roots})")])
    return path


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def resolve_paths(config: JobConfig, data: dict[str, Any], settings: Settings,
                  default_output: Path) -> Path:
    """Check every path field, write resolved ones into ``data``; returns the job folder."""
    rollout = config.rollout
    checks: list[tuple[str, str | None, str]] = [
        ("rollout.model", None if rollout.model == "tiny" else rollout.model, "dir"),
        ("rollout.tokenizer", rollout.tokenizer, "dir"),
        ("rollout.dataset.path", getattr(rollout.dataset, "path", None), "file"),
        ("rollout.engine.weight_sync_dir", getattr(rollout.engine, "weight_sync_dir", None), ""),
    ]
    for field_path, value, kind in checks:
        if value is None:
            continue
        path = _inside_roots(value, field_path, settings)
        exists = path.is_dir() if kind == "dir" else path.is_file() if kind == "file" else True
        if not exists:
            message = f"{value} is not an existing {'directory' if kind == 'dir' else 'file'}"
            raise SubmissionError(f"{field_path}: {message}", [(field_path, message)])
        _set(data, field_path, str(path))
    output_dir = (_inside_roots(config.output_dir, "output_dir", settings)
                  if config.output_dir else default_output)
    data["output_dir"] = str(output_dir)
    return output_dir


def check_runnable(config: JobConfig) -> None:
    """What pydantic cannot see (packages, paths): the driver's own preflight."""
    try:
        preflight(config)
    except ConfigError as err:
        raise from_config_error(err) from None


def resolve(text: str, overrides: list[str], settings: Settings, job_id: str,
            source: str = "<config>", output_suffix: str | None = None,
            stored_text: str | None = None) -> Resolved:
    """Validate a submission; raises SubmissionError (-> 422) before anything is stored.
    ``stored_text`` is what to keep as submitted (default: ``text``)."""
    refuse_yaml_aliases(text)
    try:
        config = parse_job_config(text, overrides, source=source)
    except ConfigError as err:
        raise from_config_error(err) from None
    except (ValueError, TypeError, RecursionError) as err:
        raise SubmissionError(f"{source}: {err}", [("<config>", str(err))]) from None
    data = config.model_dump(mode="json", exclude_unset=True)
    output_dir = resolve_paths(config, data, settings, settings.jobs_dir / job_id)
    if output_suffix and config.output_dir:
        output_dir = output_dir / output_suffix
        data["output_dir"] = str(output_dir)
    try:
        final = JobConfig.model_validate(data)
    except ValidationError as err:  # a resolved path broke a rule: report, never 500
        raise SubmissionError(f"{source}: {err}", [("<config>", str(err))]) from None
    check_runnable(final)  # after path resolution: paths are checked where they will be read
    return Resolved(final, data, output_dir, stored_text or text, list(overrides))


def config_texts(config: dict[str, Any] | None, config_yaml: str | None) -> tuple[str, str]:
    """(text to parse, text to store as submitted). A JSON object is stored as JSON and
    parsed through a YAML dump (PyYAML reads JSON's ``1e-05`` as a string)."""
    if config_yaml is not None:
        return config_yaml, config_yaml
    config = config or {}
    return yaml.safe_dump(config, sort_keys=False), json.dumps(config, indent=2)
