"""A ``forward_backward`` too big for one request, as several calls that give the same step.

The controller refuses a body over ``server.max_request_bytes`` (413). The deferred
aggregation makes split calls exact (docs/loss-aggregation.md, "Deferred"): each call's
samples are weighted by what they know alone (c'_i) and the step's denominator
D = Σ_k D_k is applied once at ``optim_step``, so calls on the parts of ``data`` and one
call on all of it give the same gradient. Under ``prompt_mean`` a group's samples stay
together in one call (its 1/T_g needs the whole group).

:func:`split_data` packs the data into parts (lists of indices into ``data``) whose
bodies fit; :func:`merge_answers` makes one answer of the parts':

    loss = Σ_k loss_k · D_k / Σ_k D_k        (the union's J: loss_k = S_k / D_k)
    logprobs = the parts' in order; valid_tokens, denominator summed; the per-token
    means (pg_loss, kl, entropy) weighted by D_k; clip_fraction and the log-prob
    mismatch weighted by valid_tokens.
"""

from __future__ import annotations

import json
from typing import Any

MARGIN = 64
"""Bytes left free in each part (the estimate of its size is exact up to a few)."""


class TooLargeToSplit(ValueError):
    """One datum (or prompt_mean group) alone is over the limit."""


def _units(data: list[dict[str, Any]], mode: str) -> list[list[int]]:
    """The indices that must travel together: a prompt_mean group, else one datum."""
    if mode != "prompt_mean":
        return [[i] for i in range(len(data))]
    groups: dict[Any, list[int]] = {}
    for i, item in enumerate(data):
        groups.setdefault(item.get("group"), []).append(i)
    return list(groups.values())


def split_data(body: dict[str, Any], limit: int) -> list[list[int]]:
    """The parts of ``body["data"]`` (a forward_backward body), as sorted indices, whose
    bodies are at most ``limit`` bytes each; whole groups under prompt_mean."""
    data = body["data"]
    mode = (body.get("aggregation") or {}).get("mode", "sample_mean")
    rest = {k: v for k, v in body.items() if k not in ("data", "request_id")}
    budget = limit - len(json.dumps({**rest, "data": [], "request_id": "x" * 64})) - MARGIN
    parts: list[list[int]] = []
    size = 0
    for unit in _units(data, mode):
        unit_size = sum(len(json.dumps(data[i])) + 2 for i in unit)
        if unit_size > budget:
            what = f"group {data[unit[0]].get('group')}" if len(unit) > 1 else "it"
            raise TooLargeToSplit(f"data[{unit[0]}]: {what} alone is {unit_size} bytes, over "
                                  f"the controller's server.max_request_bytes ({limit})")
        if parts and size + unit_size <= budget:
            parts[-1].extend(unit)
            size += unit_size
        else:
            parts.append(list(unit))
            size = unit_size
    return [sorted(part) for part in parts]


def part_body(body: dict[str, Any], part: list[int]) -> dict[str, Any]:
    return {**{k: v for k, v in body.items() if k != "data"},
            "data": [body["data"][i] for i in part]}


def merge_answers(answers: list[dict[str, Any]], parts: list[list[int]]) -> dict[str, Any]:
    """One answer of the parts' answers (``parts``: :func:`split_data`'s)."""
    order = [i for part in parts for i in part]
    denominators = [a["metrics"]["denominator"] for a in answers]
    total = sum(denominators)
    tokens = [a["metrics"]["valid_tokens"] for a in answers]
    all_tokens = sum(tokens)

    def weighted(values: list[float], weights: list[float], whole: float) -> float:
        return sum(v * w for v, w in zip(values, weights, strict=True)) / whole if whole else 0.0

    logprobs: list[Any] = [None] * len(order)
    flat = [row for a in answers for row in a["logprobs"]]
    for position, row in zip(order, flat, strict=True):
        logprobs[position] = row
    metrics = {**answers[-1]["metrics"], "valid_tokens": all_tokens, "denominator": total,
               "parts": float(len(answers))}
    for name in ("pg_loss", "kl", "entropy"):
        metrics[name] = weighted([a["metrics"][name] for a in answers], denominators, total)
    for name in ("clip_fraction", "mismatch/log_prob_abs_diff"):
        if all(name in a["metrics"] for a in answers):
            metrics[name] = weighted([a["metrics"][name] for a in answers], tokens,
                                     all_tokens)
    return {"loss": weighted([a["loss"] for a in answers], denominators, total),
            "logprobs": logprobs, "metrics": metrics}
