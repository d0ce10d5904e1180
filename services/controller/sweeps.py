"""Sweeps: one config, many jobs, grouped. The ScaleRL-style ablation of the four
aggregation modes is ``modes=[sample_mean, token_mean, prompt_mean, constant]``."""

from __future__ import annotations

import re

from services.config.job import JobConfig
from trainer.config import AggregationMode

NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def mode_overrides(base: JobConfig, mode: AggregationMode) -> list[str]:
    """Overrides that switch ``base`` to ``mode`` and keep it valid: constant needs a
    divisor (the base's, or Dr. GRPO's max_response_len); the other modes refuse one."""
    overrides = [f"aggregation.mode={mode}"]
    if base.aggregation.calculate_per_token_loss:
        overrides.append("aggregation.calculate_per_token_loss=false")
    if mode == "constant" and base.aggregation.divisor is None:
        overrides.append("aggregation.divisor=max_response_len")
    elif mode != "constant" and base.aggregation.divisor is not None:
        overrides.append("aggregation.divisor=null")
    return overrides


def job_name(base_name: str, label: str) -> str:
    """``<base>-<label>``, made a valid job name (letters, digits, '-', '_', '.')."""
    suffix = NAME_UNSAFE.sub("_", label).strip("_.-") or "run"
    return f"{base_name[:100 - len(suffix) - 1]}-{suffix}"


def variants(base: JobConfig, modes: list[AggregationMode] | None,
             override_sets: list[list[str]] | None) -> list[tuple[str, list[str]]]:
    """(label, extra overrides) of each job of the sweep, in order."""
    if modes is not None:
        return [(mode, [*mode_overrides(base, mode), f"name={job_name(base.name, mode)}"])
                for mode in modes]
    out = []
    for index, overrides in enumerate(override_sets or []):
        label = ",".join(overrides) or f"run{index}"
        out.append((label[:200], [*overrides, f"name={job_name(base.name, f'{index}')}"]))
    return out
