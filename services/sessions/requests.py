"""What a training session's calls carry, checked before anything runs.

A ``Datum`` is one sequence the Tinker way: ``tokens`` (the model's input), ``targets``
(the next token at each position: ``targets[t] == tokens[t + 1]``) and ``weights`` (the
loss weight m_t of each target in [0, 1]: 0 on prompt and environment tokens, 1 on the
tokens the loss trains, a fraction to train a token partly; M = Σ_t m_t is the sample's
size in tokens for every mode), with ``advantages`` (one per target, free to differ from
token to token) and sampling ``logprobs`` per target when the loss needs them. Pydantic
checks each field's type; :func:`check_data` checks what needs the whole datum or the
model (lengths, the vocabulary, groups), each problem named ``data[i].field[t]``.
A datum becomes one sample of a ``RolloutBatch`` (:func:`call_batch`): the sequence is
``tokens + [targets[-1]]``, and the weight of target t is the mask of position t + 1.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.batch import RolloutBatch
from rollout.config import SamplingConfig
from rollout.problems import Problem
from trainer.config import AGGREGATION_MODES, AggregationMode, RolloutCorrectionConfig

LossFn = Literal["cross_entropy", "importance_sampling", "ppo", "gspo", "cispo"]
"""A call's pg term: a built-in policy loss of trainer/losses/ by its job name."""
NEEDS_ADVANTAGES: tuple[LossFn, ...] = ("importance_sampling", "ppo", "gspo", "cispo")
NEEDS_LOGPROBS: tuple[LossFn, ...] = ("importance_sampling", "ppo", "gspo", "cispo")
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl", "k3+"]
MAX_DATA = 4096
MAX_TOKENS = 32768

_STRICT = ConfigDict(extra="forbid", frozen=True)


def _request_id() -> Any:
    """A call's ``request_id`` (the client makes one per call): a retry with the same id
    gets the first answer, applied once (services/sessions/replay.py)."""
    return Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")


FINITE = {"allow_inf_nan": False}
"""inf and NaN refused, naming the field ("Input should be a finite number")."""


class Datum(BaseModel):
    model_config = _STRICT

    tokens: list[int] = Field(min_length=1, max_length=MAX_TOKENS)
    targets: list[int]
    weights: list[float]
    advantages: list[float] | None = None
    logprobs: list[float] | None = None
    group: int | None = None
    temperature: float | None = Field(default=None, ge=0, **FINITE)
    """The temperature ``logprobs`` were sampled at (``sample`` says it); one that is not
    the session's loss temperature is refused (the ratios would be wrong)."""


class Aggregation(BaseModel):
    model_config = _STRICT

    mode: AggregationMode = "sample_mean"
    divisor: float | None = Field(default=None, gt=0, **FINITE)
    """L of the constant mode (required there, refused elsewhere)."""

    @model_validator(mode="after")
    def _divisor_with_constant(self) -> Aggregation:
        if self.mode == "constant" and self.divisor is None:
            raise ValueError("divisor: mode constant needs a divisor L > 0")
        if self.mode != "constant" and self.divisor is not None:
            raise ValueError(f"divisor: only mode constant takes one (mode is {self.mode})")
        return self


class ForwardBackward(BaseModel):
    model_config = _STRICT

    data: list[Datum] = Field(min_length=1, max_length=MAX_DATA)
    loss_fn: LossFn = "cross_entropy"
    """The pg term (Tinker's name); ``policy_loss`` is the jobs' name for it."""
    policy_loss: LossFn | None = None
    """``trainer.loss.policy_loss`` per call: the same as ``loss_fn`` (give either, or both
    equal)."""
    kl_estimator: KLEstimator | None = None
    """``trainer.loss.kl_estimator`` for this call (None: the session's); refused as the
    session's config refuses it (k1, or k3 without allow_biased_kl_gradient, with a KL)."""
    rollout_correction: RolloutCorrectionConfig | None = None
    """``trainer.loss.rollout_correction`` for this call (None: the session's)."""
    aggregation: Aggregation = Aggregation()
    request_id: str | None = _request_id()

    @model_validator(mode="before")
    @classmethod
    def _one_policy_loss(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("policy_loss") is None:
            return data
        if "loss_fn" in data and data["loss_fn"] != data["policy_loss"]:
            raise ValueError(f"policy_loss: is {data['policy_loss']} but loss_fn is "
                             f"{data['loss_fn']}; they name the same term: give one")
        return {**data, "loss_fn": data["policy_loss"]}  # one name from here on


class Adam(BaseModel):
    model_config = _STRICT

    lr: float = Field(gt=0, **FINITE)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0, **FINITE)
    weight_decay: float = Field(default=0.0, ge=0, **FINITE)

    @model_validator(mode="after")
    def _betas_in_range(self) -> Adam:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: each must be in [0, 1), got {list(self.betas)}")
        return self


class OptimStep(BaseModel):
    model_config = _STRICT

    adam: Adam
    grad_clip: float | None = Field(default=None, gt=0, **FINITE)
    """Clip the step's global gradient norm (after the aggregation's scaling)."""
    request_id: str | None = _request_id()


class Sample(BaseModel):
    model_config = _STRICT

    prompt_tokens: list[list[int]] = Field(min_length=1, max_length=1024)
    num_samples: int = Field(default=1, ge=1, le=256)
    sampling: SamplingConfig | None = None
    """The session's ``rollout.sampling`` when unset (its temperature is the one the
    trainer's log-probs use)."""
    seed: int | None = None
    """None: the session's seed and a counter of its sample calls."""
    request_id: str | None = _request_id()


class Save(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    request_id: str | None = _request_id()


def _length_problems(i: int, datum: Datum) -> list[Problem]:
    size = len(datum.tokens)
    return [Problem(f"data[{i}].{name}", f"has {len(values)} values; tokens has {size}")
            for name, values in (("targets", datum.targets), ("weights", datum.weights),
                                 ("advantages", datum.advantages),
                                 ("logprobs", datum.logprobs))
            if values is not None and len(values) != size]


def vocabulary_problem(field: str, ids: list[int], vocab_size: int) -> Problem | None:
    """The first token id of ``ids`` outside the vocabulary, named ``field[t]``."""
    bad = next((t for t, token in enumerate(ids) if not 0 <= token < vocab_size), None)
    if bad is None:
        return None
    return Problem(f"{field}[{bad}]",
                   f"token id {ids[bad]} is outside the vocabulary (0..{vocab_size - 1})")


def _datum_problems(i: int, datum: Datum, vocab_size: int, loss_fn: LossFn) -> list[Problem]:
    problems = _length_problems(i, datum)
    if problems:
        return problems
    for name, ids in (("tokens", datum.tokens), ("targets", datum.targets)):
        if (problem := vocabulary_problem(f"data[{i}].{name}", ids, vocab_size)) is not None:
            problems.append(problem)
    bad = next((t for t, w in enumerate(datum.weights)
                if not (math.isfinite(w) and 0.0 <= w <= 1.0)), None)
    if bad is not None:
        problems.append(Problem(f"data[{i}].weights[{bad}]", (
            f"is {datum.weights[bad]}; a weight is the token's share of the loss, in [0, 1] "
            "(scale a token's loss with its advantage)")))
    bad = next((t for t in range(len(datum.tokens) - 1)
                if datum.targets[t] != datum.tokens[t + 1]), None)
    if bad is not None:
        problems.append(Problem(f"data[{i}].targets[{bad}]", (
            f"is {datum.targets[bad]} but tokens[{bad + 1}] is {datum.tokens[bad + 1]}: "
            "targets are the sequence's next tokens")))
    for name in ("advantages", "logprobs"):
        values = getattr(datum, name) or []
        bad = next((t for t, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:
            problems.append(Problem(f"data[{i}].{name}[{bad}]",
                                    f"is {values[bad]}; must be finite"))
    if loss_fn in NEEDS_ADVANTAGES and datum.advantages is None:
        problems.append(Problem(f"data[{i}].advantages", f"required by loss_fn {loss_fn}"))
    if loss_fn in NEEDS_LOGPROBS and datum.logprobs is None:
        problems.append(Problem(f"data[{i}].logprobs",
                                f"required by loss_fn {loss_fn} (the sampling log-probs)"))
    return problems


def temperature_problem(i: int, datum: Datum, temperature: float | None) -> Problem | None:
    """A datum sampled at another temperature than the loss's τ: its log-probs (and so
    PPO's and importance sampling's ratios π_T/π_sample) would compare two policies."""
    if datum.temperature is None or temperature is None or \
            abs(datum.temperature - temperature) <= 1e-6:
        return None
    return Problem(f"data[{i}].temperature", (
        f"is {datum.temperature:g} but the session's loss temperature is {temperature:g} "
        f"(rollout.sampling.temperature): sample at {temperature:g}, or start a session "
        "with that temperature"))


def check_data(request: ForwardBackward, vocab_size: int,
               earlier_groups: set[int] = frozenset(),
               temperature: float | None = None) -> list[Problem]:
    """Every problem of a call's data; ``earlier_groups``: the groups earlier calls of
    this step held (prompt_mean: a group is whole within one call); ``temperature``: the
    loss's τ, which a datum's ``temperature`` must equal."""
    problems = [p for i, datum in enumerate(request.data)
                for p in _datum_problems(i, datum, vocab_size, request.loss_fn)]
    problems += [p for i, datum in enumerate(request.data)
                 if (p := temperature_problem(i, datum, temperature)) is not None]
    if request.aggregation.mode == "prompt_mean":
        problems += _group_problems(request.data, earlier_groups)
    return problems


def _group_problems(data: list[Datum], earlier_groups: set[int]) -> list[Problem]:
    missing = next((i for i, d in enumerate(data) if d.group is None), None)
    if missing is not None:
        return [Problem(f"data[{missing}].group", "required by aggregation mode prompt_mean "
                        "(the prompt group each sample belongs to)")]
    first: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for i, datum in enumerate(data):
        first.setdefault(datum.group, i)
        sizes[datum.group] = sizes.get(datum.group, 0) + 1
    for group, i in first.items():
        if group in earlier_groups:
            return [Problem(f"data[{i}].group", (
                f"group {group} was in an earlier forward_backward call of this step; under "
                "prompt_mean every group is whole within one call"))]
    size = max(sizes.values())
    short = next((g for g in first if sizes[g] != size), None)
    if short is not None:
        return [Problem(f"data[{first[short]}].group", (
            f"group {short} has {sizes[short]} samples in this call, other groups have "
            f"{size}; under prompt_mean every group is whole within one call"))]
    return []


def call_batch(data: list[Datum], mode: str, pad_token_id: int = 0,
               full_mask: bool = False) -> RolloutBatch:
    """One call's data as a RolloutBatch (checked data only). ``full_mask``: every target
    weighted (the batch the log-probs of every target are read from)."""
    lengths = [len(d.tokens) + 1 for d in data]
    width = max(lengths)
    ids = torch.full((len(data), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros(len(data), width)
    sampled = torch.zeros(len(data), width)
    advantages = torch.zeros(len(data), width)
    prompt_lengths, response_lengths = [], []
    for i, datum in enumerate(data):
        size = len(datum.tokens)
        ids[i, :size + 1] = torch.tensor([*datum.tokens, datum.targets[-1]])
        mask[i, 1:size + 1] = 1.0 if full_mask else torch.tensor(datum.weights)
        if datum.logprobs is not None:
            sampled[i, 1:size + 1] = torch.tensor(datum.logprobs)
        if datum.advantages is not None and not full_mask:
            advantages[i, 1:size + 1] = torch.tensor(datum.advantages)
        weighted = mask[i].nonzero().flatten().tolist()
        start = weighted[0] if weighted else size
        prompt_lengths.append(start)
        response_lengths.append(size + 1 - start)
        advantages[i, :start] = 0.0  # the prompt's: no loss is taken there
    sampled = sampled * (mask > 0)
    if mode == "prompt_mean" and not full_mask:
        groups = [d.group for d in data]
        dense = {g: k for k, g in enumerate(dict.fromkeys(groups))}
        group_index = torch.tensor([dense[g] for g in groups])
        group_size = len(data) // len(dense)
    else:
        group_index, group_size = torch.arange(len(data)), 1
    return RolloutBatch(
        input_ids=ids, prompt_lengths=torch.tensor(prompt_lengths),
        response_lengths=torch.tensor(response_lengths), loss_mask=mask,
        rollout_log_probs=sampled, rewards=torch.zeros(len(data)),
        advantages=advantages, group_index=group_index,
        samples_per_prompt=group_size, pad_token_id=pad_token_id)


def target_log_probs(log_probs: torch.Tensor, data: list[Datum]) -> list[list[float]]:
    """Per datum, the log-prob of each target: ``log_probs`` [N, S] of the full-mask
    batch, aligned with its input ids (target t is position t + 1)."""
    return [log_probs[i, 1:len(d.tokens) + 1].tolist() for i, d in enumerate(data)]


__all__ = ["AGGREGATION_MODES", "Adam", "Aggregation", "Datum", "ForwardBackward",
           "OptimStep", "Sample", "Save", "call_batch", "check_data", "target_log_probs"]
