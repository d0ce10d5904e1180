"""A training session: a trainer group and one engine that a user's own loop drives.

    forward_backward × k ──► gradients accumulate (each call weighted by its own c'_i)
    optim_step ───────────► × 1/ΣD, clip, AdamW step        (trainer/aggregation.py)
    sample ───────────────► the engine, synced to the last step first

Several ``forward_backward`` calls then one ``optim_step`` give exactly the gradient of
one call on the union of their data: each call's samples are weighted by what they know
alone (c'_i: 1/M_i, 1, 1/T_g or 1) and the step's denominator D (N, ΣM, P or L·N) is
the sum of the calls' parts, applied once when the step is taken
(docs/loss-aggregation.md, "Deferred"). The calls of one step share one mode (and L).
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
import torch
from pydantic import ValidationError

from rollout.problems import Problem, problems_detail
from services.config.errors import validation_error
from services.config.job import JobConfig
from services.driver.run_dir import CHECKPOINTS_DIR
from services.driver.transports.object_store import ObjectStoreTransport
from services.runtime.gang import Gang, Roles
from services.runtime.placement import JobPlacement
from services.sessions.group import CallUndone, GradientsLost, SessionGroup
from services.sessions.replay import RecentCalls
from services.sessions.requests import (
    Datum,
    ForwardBackward,
    OptimStep,
    Sample,
    call_batch,
    check_data,
    target_log_probs,
    vocabulary_problem,
)
from trainer.aggregation import call_coefficients
from trainer.checkpoint import ADAPTER_DIR
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.export import export_checkpoint


class SessionError(ValueError):
    """A call the session refuses or could not do: ``status`` (409, 422, 500) and the
    Problems (field, message); ``retriable``: the call changed nothing, so sending it
    again (same ``request_id``) is safe."""

    def __init__(self, status: int, problems: list[Problem], retriable: bool = False
                 ) -> None:
        super().__init__(problems_detail(problems))
        self.status, self.problems, self.retriable = status, problems, retriable


@dataclass
class PendingStep:
    """What the ``forward_backward`` calls since the last ``optim_step`` accumulated."""

    mode: str | None = None
    divisor: float | None = None
    calls: int = 0
    denominator: float = 0.0
    """Σ_k D_k over the calls."""
    sums: dict[str, float] = field(default_factory=dict)
    """Σ_k of each logged sum (Σ c'·ℓ and the counts)."""
    groups: set[int] = field(default_factory=set)


def _mode_text(mode: str | None, divisor: float | None) -> str:
    return f"mode {mode}" + ("" if divisor is None else f" (L={divisor:g})")


def loss_for(base: LossConfig, request: ForwardBackward) -> LossConfig:
    """The session's loss terms with the call's pg term (``loss_fn``/``policy_loss``) and,
    where it names them, its ``kl_estimator`` and ``rollout_correction``; a ratio is to the
    sampling log-probs (the datums carry no other old policy). Validated as a job's
    ``trainer.loss`` is (a clip range left at ppo's default is another loss's default, so
    gspo takes its own), a refusal a 422 naming the field."""
    update: dict[str, Any] = {"policy_loss": request.loss_fn}
    if request.loss_fn in ("ppo", "gspo", "cispo"):
        update["old_log_probs"] = "rollout"
    if request.kl_estimator is not None:
        update["kl_estimator"] = request.kl_estimator
    if request.rollout_correction is not None:
        update["rollout_correction"] = request.rollout_correction.model_dump()
        update["tis_cap"] = None  # the call's correction replaces the session's
    settings = base.model_dump(exclude_unset=True)
    if request.loss_fn != base.policy_loss:  # a clip range left at the default is the
        default = LossConfig.model_fields  # new loss's default (gspo's is its own)
        for name in ("eps_clip", "eps_clip_high"):
            if settings.get(name, default[name].default) == default[name].default:
                settings.pop(name, None)
    try:
        return LossConfig.model_validate({**settings, **update})
    except ValidationError as err:  # the call's settings, as a job's trainer.loss is told
        refused = validation_error(err, "forward_backward", LossConfig).problems
        raise SessionError(422, [Problem(p.field, p.message) for p in refused]) from err


def session_objective(config: JobConfig) -> ObjectiveConfig:
    """The objective a session's ranks start with (each call says its own mode)."""
    return ObjectiveConfig(pg=AggregationConfig(mode="sample_mean"),
                           temperature=config.rollout.sampling.temperature)


def session_roles(config: JobConfig, model_path: str, folder: Path) -> Roles:
    """A session's gang: its trainer ranks (SessionGroup) and one engine (the controller
    sets ``rollout.engine.num_engines: 1``), which loads while the ranks do."""
    def policy(placement: JobPlacement | None) -> SessionGroup:
        return SessionGroup(config.trainer, session_objective(config), model_path,
                            total_steps=1, placement=placement and placement.group,
                            name=f"tally-session-{folder.name}")

    return Roles(policy=policy, engines=True)


class TrainingSession:
    def __init__(self, gang: Gang, folder: Path) -> None:
        """Drive ``gang`` (:func:`session_roles`, started); ``folder`` holds saves and
        checkpoints."""
        assert gang.config is not None
        self.gang, self.config, self.model_path = gang, gang.config, gang.model_path
        self.folder = folder
        self.temperature = self.config.rollout.sampling.temperature
        self.objective = session_objective(self.config)
        self.lock = threading.Lock()
        self.engine = gang.engines[0]
        self.trainer: SessionGroup = gang.trainer
        self._engine_get(self.engine.ping.remote(), "ping")
        from transformers import AutoConfig

        self.vocab_size = int(AutoConfig.from_pretrained(self.model_path).vocab_size)
        self.step = 0
        self.engine_version = 0
        self.tokens = 0
        self.samples_drawn = 0
        self.pending = PendingStep()
        self.loss: LossConfig | None = None
        """The loss terms the ranks hold (the last call's: ``loss_for``)."""
        self.last: dict[str, Any] = {}
        self.last_call = time.monotonic()
        self.ended: str | None = None
        """Why the session ended (idle, closed); it takes no call after."""
        self.recent = RecentCalls()
        """The answers of the last calls by request_id (services/sessions/replay.py)."""
        self.gradients_unknown = False
        """A failed call could not restore the ranks' gradients: the next call drops them."""

    # ---- the verbs ----------------------------------------------------------------------

    def _use_loss(self, request: ForwardBackward) -> None:
        loss = loss_for(self.config.trainer.loss, request)
        if loss != self.loss:
            self.trainer.use_loss(loss)
            self.loss = loss

    def _prepare(self, request: ForwardBackward, for_step: bool) -> tuple[Any, Any, float]:
        """(batch, plan with the call's c'_i, the call's D) of a checked request."""
        mode, divisor = request.aggregation.mode, request.aggregation.divisor
        if for_step and self.pending.calls and (mode, divisor) != (self.pending.mode,
                                                                    self.pending.divisor):
            raise SessionError(409, [Problem("aggregation.mode", (
                f"{_mode_text(mode, divisor)} differs from "
                f"{_mode_text(self.pending.mode, self.pending.divisor)} of the "
                f"{self.pending.calls} forward_backward call(s) pending; the calls of one "
                "step share one mode: call optim_step first"))])
        problems = check_data(request, self.vocab_size,
                              self.pending.groups if for_step else set(), self.temperature)
        if problems:
            raise SessionError(422, problems)
        batch = call_batch(request.data, mode)
        coefficients, denominator = call_coefficients(
            batch.loss_mask.to(torch.float64).sum(dim=-1), batch.group_index, mode, divisor)
        plan = self.trainer.plan(batch)
        plan = replace(plan, coefficients={"pg": coefficients, "kl": coefficients,
                                           "entropy": coefficients})
        self._use_loss(request)
        return batch, plan, denominator

    def _objective(self, sums: dict[str, float], denominator: float) -> float:
        """J of the terms the backward takes: (Σ pg + β Σ kl − α Σ H) / D."""
        loss = self.config.trainer.loss
        total = sums["pg_loss"] + loss.kl_coef * sums["kl"] - loss.entropy_coef * sums["entropy"]
        return total / denominator if denominator > 0 else 0.0

    def _log_probs(self, data: list[Datum]) -> list[list[float]]:
        return target_log_probs(self.trainer.log_probs(call_batch(data, "token_mean",
                                                                  full_mask=True)), data)

    def forward_backward(self, request: ForwardBackward) -> dict[str, Any]:
        """Accumulate the call's gradient, all or nothing: a call that fails on any rank
        leaves every rank's gradient and ``pending`` as before it (500, retriable), or,
        when the ranks cannot restore, drops the whole step's accumulation and says so."""
        if self.gradients_unknown:
            self.trainer.discard_gradients()
            self.gradients_unknown = False
        batch, plan, denominator = self._prepare(request, for_step=True)
        logprobs = self._log_probs(request.data)  # before: a failure here changes nothing
        try:
            sums = self.trainer.accumulate(batch, plan)
        except CallUndone as err:
            raise SessionError(500, [Problem("forward_backward", f"{err}; nothing of it is "
                                             "applied: send it again")], retriable=True) from err
        except GradientsLost as err:
            dropped, self.pending = self.pending.calls, PendingStep()
            self.gradients_unknown = True
            raise SessionError(500, [Problem("forward_backward", (
                f"{err}: the {dropped} earlier forward_backward call(s) of this step are "
                "dropped too; start the step again"))]) from err
        pending = self.pending
        if not pending.calls:
            pending.mode = request.aggregation.mode
            pending.divisor = request.aggregation.divisor
        pending.calls += 1
        pending.denominator += denominator
        pending.sums = {k: pending.sums.get(k, 0.0) + v for k, v in sums.items()
                        if k in SUMMED}
        pending.groups |= {d.group for d in request.data if d.group is not None}
        self.tokens += batch.num_valid_tokens
        return {"loss": self._objective(sums, denominator), "logprobs": logprobs,
                "metrics": self._call_metrics(sums, denominator)}

    def forward(self, request: ForwardBackward) -> dict[str, Any]:
        batch, plan, denominator = self._prepare(request, for_step=False)
        sums = self.trainer.evaluate(batch, plan)
        return {"loss": self._objective(sums, denominator),
                "logprobs": self._log_probs(request.data),
                "metrics": self._call_metrics(sums, denominator)}

    def _call_metrics(self, sums: dict[str, float], denominator: float) -> dict[str, float]:
        return {"valid_tokens": sums["valid_tokens"], "denominator": denominator,
                "pg_loss": sums["pg_loss"] / denominator if denominator else 0.0,
                "kl": sums["kl"] / denominator if denominator else 0.0,
                "entropy": sums["entropy"] / denominator if denominator else 0.0,
                "clip_fraction": sums["clip_fraction"],
                "mismatch/log_prob_abs_diff": sums["mismatch/log_prob_abs_diff"],
                "pending_calls": float(self.pending.calls)}

    def optim_step(self, request: OptimStep) -> dict[str, Any]:
        pending = self.pending
        if not pending.calls:
            raise SessionError(409, [Problem("optim_step", (
                "no forward_backward call since the last optim_step: there is no gradient "
                "to step with"))])
        if pending.denominator <= 0:  # token_mean over calls without a weighted token
            self.drop_pending()
            raise SessionError(409, [Problem("optim_step", "the pending calls hold no weighted "
                                             "token (every weight is 0); they are dropped")])
        if pending.sums.get("valid_tokens", 0.0) <= 0:  # a zero gradient would still move
            calls = pending.calls                       # Adam's moments and step count
            self.drop_pending()
            raise SessionError(409, [Problem("optim_step", f"the {calls} pending forward_backward "
                                             "call(s) hold no weighted token (every weight is 0): "
                                             "there is no gradient to step with; they are dropped "
                                             "and the optimizer is untouched")])
        scale = 1.0 / pending.denominator
        result = self.trainer.apply_gradients(scale, request.adam.model_dump(mode="python"),
                                              request.grad_clip)
        self.step += 1
        metrics = {"loss": self._objective(pending.sums, pending.denominator),
                   "grad_norm": result["grad_norm"], "lr": result["lr"],
                   "calls": float(pending.calls), "denominator": pending.denominator,
                   "valid_tokens": pending.sums["valid_tokens"]}
        self.pending = PendingStep()
        self.last = {"step": self.step, **metrics}
        return {"step": self.step, "grad_norm": result["grad_norm"], "loss": metrics["loss"],
                "metrics": metrics}

    def sample(self, request: Sample) -> dict[str, Any]:
        from rollout.token_budget import model_context, sample_problem

        context = model_context(self.model_path)  # prompt + max_new_tokens must fit it
        max_new_tokens = (request.sampling or self.config.rollout.sampling).max_new_tokens
        for i, prompt in enumerate(request.prompt_tokens):
            if (problem := vocabulary_problem(f"prompt_tokens[{i}]", prompt,
                                              self.vocab_size)) is not None:
                raise SessionError(422, [problem])
            if not prompt:
                raise SessionError(422, [Problem(f"prompt_tokens[{i}]", "is empty")])
            if (problem := sample_problem(f"prompt_tokens[{i}]", len(prompt),
                                          max_new_tokens, context)) is not None:
                raise SessionError(422, [problem])
        self._sync_engine()
        sampling = request.sampling or self.config.rollout.sampling
        seed = request.seed if request.seed is not None else (
            self.config.rollout.seed * 1_000_003 + self.samples_drawn)
        prompts = [p for p in request.prompt_tokens for _ in range(request.num_samples)]
        generations = self._engine_get(self.engine.generate.remote(prompts, sampling, seed),
                                       "generate")
        self.samples_drawn += 1  # after: a call that timed out draws the same seed again
        n = request.num_samples
        # each sequence says its temperature: forward_backward refuses a datum sampled at
        # another one than the loss's (its ratios would be wrong)
        return {"sequences": [[{"tokens": g.token_ids, "logprobs": g.log_probs,
                                "finish_reason": g.finish_reason,
                                "temperature": sampling.temperature}
                               for g in generations[k * n:(k + 1) * n]]
                              for k in range(len(request.prompt_tokens))],
                "step": self.step}

    def _sync_engine(self) -> None:
        """The engine serves the weights of the last optim_step (sent once per step)."""
        if self.engine_version == self.step:
            return
        engine = self.config.rollout.engine
        transport = ObjectStoreTransport(self.trainer, self.engine,
                                         getattr(engine, "dtype", "float32"),
                                         self.config.trainer.weight_sync.bucket_mb)
        loaded, _ = transport.send_weights(self.step)
        self._engine_get(loaded, "load of the weights")  # unset version: the next call resends
        self.engine_version = self.step

    def _engine_get(self, ref: Any, verb: str) -> Any:
        """The engine's answer within rollout.call_timeout_s; past it a 504 the caller may
        send again (nothing of the session changed)."""
        timeout = self.config.rollout.call_timeout_s
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise SessionError(504, [Problem("engine", (
                f"the engine's {verb} took longer than rollout.call_timeout_s={timeout:g} s"
            ))], retriable=True) from None

    def save(self, name: str) -> dict[str, Any]:
        """The weights as a Hugging Face folder (LoRA: peft's adapter folder) at
        ``saved/<name>``, and the whole trainer state (optimizer included) under
        ``checkpoints/<name>`` for :meth:`load`."""
        if self.pending.calls:
            raise SessionError(409, [Problem("save", (
                f"{self.pending.calls} forward_backward call(s) are pending; call optim_step "
                "first"))])
        checkpoint = self.folder / CHECKPOINTS_DIR / name
        shutil.rmtree(checkpoint, ignore_errors=True)
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        self.trainer.save_checkpoint(str(checkpoint))
        (checkpoint / "session_step").write_text(str(self.step))
        adapter = (checkpoint / ADAPTER_DIR).is_dir()
        out = export_checkpoint(checkpoint, self.folder / "saved" / name, adapter=adapter)
        return {"path": str(out), "step": self.step, "adapter": adapter}

    def drop_pending(self) -> None:
        """Forget the forward_backward calls since the last step, gradients included."""
        self.trainer.discard_gradients()
        self.pending = PendingStep()

    def load(self, name: str) -> dict[str, Any]:
        """Back to a save of this session: weights, optimizer state and step."""
        checkpoint = self.folder / CHECKPOINTS_DIR / name
        if not checkpoint.is_dir():
            raise SessionError(404, [Problem("name", f"no save named {name!r} in this session")])
        self.drop_pending()
        self.trainer.load_checkpoint(str(checkpoint))
        self.step = int((checkpoint / "session_step").read_text())
        self.engine_version = -1  # whatever the engine serves, it is not this
        return {"step": self.step}

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "pending_calls": self.pending.calls,
                "pending_mode": self.pending.mode, "tokens": self.tokens,
                "last": self.last, "world_size": self.config.trainer.world_size,
                "model": self.config.rollout.model}

    def close(self) -> None:
        """Stop the session's gang: its ranks, its engine, its bundles."""
        self.gang.close()


SUMMED = ("pg_loss", "kl", "entropy", "valid_tokens")
"""The logged sums a step adds over its calls."""

