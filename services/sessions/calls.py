"""A training session's ranks: the FSDP policy rank with the session's verbs, its
``forward_backward`` a transaction over the ranks (composed here, in services: the trainer
ranks carry only their role's verbs; the group that calls these: services/sessions/group.py).

    group                        every rank
    forward_backward_call ─────► accumulated gradients set aside (g_acc), .grad = None,
                                 forward_backward into fresh .grad (g_call)
      every rank answered ─────► commit_call:  .grad = g_acc + g_call
      a rank failed ───────────► restore_call: .grad = g_acc (g_call dropped)

FSDP2's reduce-scatter in the backward writes the call's summed shard into an empty
``.grad``; adding the set-aside shard back afterwards gives the same bits as letting it
accumulate (IEEE addition commutes: g_acc + g_call = g_call + g_acc). The cost is one
more gradient shard per rank while a call runs.

A rank that fails after its collectives (an error in its own bookkeeping, the test-only
:meth:`arm_fault`) leaves its peers free, so every rank restores. A rank that fails
inside a collective leaves its peers waiting in it until ``collective_timeout_s``; the
group's ``call_timeout_s`` bounds the restore that queues behind it, and the session
says the accumulation is lost (services/sessions/group.py, ``GradientsLost``).
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.batch import RolloutBatch
from trainer.backends.fsdp.worker import FSDPWorker
from trainer.config import LossConfig
from trainer.step_plan import StepPlan


class InjectedFault(RuntimeError):
    """The failure :meth:`SessionCalls.arm_fault` asked for (tests only)."""


class SessionCalls(FSDPWorker):
    """The transactional verbs over the policy's ``forward_backward`` (``trained``: the
    parameters the optimizer steps, set by ``setup``)."""

    _set_aside: list[Any] | None = None
    _armed: dict[str, int] | None = None

    def forward_backward_call(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Collective: ``forward_backward`` into fresh gradients, the accumulated ones set
        aside until :meth:`commit_call` or :meth:`restore_call`."""
        if self._set_aside is not None:  # a call never settled: its gradient is not kept
            self.restore_call()
        self._set_aside = [p.grad for p in self.trained]
        for p in self.trained:
            p.grad = None
        sums = self.forward_backward(batch, plan)
        self._maybe_fail("forward_backward")
        return sums

    def commit_call(self) -> None:
        """The call's gradients join the accumulated ones (every rank succeeded)."""
        if self._set_aside is None:
            return
        for p, kept in zip(self.trained, self._set_aside, strict=True):
            if kept is not None and p.grad is not None:
                kept.add_(p.grad)
            if kept is not None:
                p.grad = kept
        self._set_aside = None

    def restore_call(self) -> None:
        """Back to the gradients from before the call (some rank failed it)."""
        if self._set_aside is None:
            return
        for p, kept in zip(self.trained, self._set_aside, strict=True):
            p.grad = kept
        self._set_aside = None

    def arm_fault(self, verb: str, times: int = 1) -> None:
        """Test-only: the next ``times`` calls of ``verb`` (``forward_backward``) on this
        rank raise :class:`InjectedFault` after their collectives (so no peer hangs)."""
        self._armed = {**(self._armed or {}), verb: times}

    def armed_faults(self) -> dict[str, int]:
        """Test-only: the faults still armed on this rank."""
        return {verb: n for verb, n in (self._armed or {}).items() if n > 0}

    def _maybe_fail(self, verb: str) -> None:
        left = (self._armed or {}).get(verb, 0)
        if left > 0:
            self._armed = {**(self._armed or {}), verb: left - 1}
            raise InjectedFault(f"injected fault in {verb} (arm_fault)")


class SessionRank(SessionCalls):
    """A session's rank: gradients accumulated over calls, then one step when asked."""

    def use_loss(self, loss: LossConfig) -> None:
        """The loss terms of the calls that follow (a session's ``loss_fn``); the KL
        coefficient stays the configured one (it decided the reference model)."""
        self.config = self.config.model_copy(update={"loss": loss.model_copy(
            update={"kl_coef": self.config.loss.kl_coef})})

    @torch.no_grad()
    def forward_only(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Collective, no gradient: the sums ``forward_backward`` would return."""
        return self._objective_sums(batch, plan, backward=False)

    def apply_gradients(self, scale: float, adam: dict[str, Any], grad_clip: float | None
                        ) -> dict[str, float]:
        """Collective: the gradients ``forward_backward`` calls accumulated, times
        ``scale`` (the step's 1/ΣD, trainer/aggregation.py), clipped to ``grad_clip``,
        then one optimizer step with ``adam``'s settings (lr, betas, eps, weight_decay;
        no schedule); returns ``grad_norm`` (scaled, before clipping) and ``lr``."""
        for p in self.trained:
            if p.grad is not None:
                p.grad.mul_(scale)
        for group in self.optimizer.param_groups:
            group.update(adam)
        return {"grad_norm": self._clip_and_step(grad_clip), "lr": float(adam["lr"])}

    def discard_gradients(self) -> None:
        """Drop the accumulated gradients (a session restored from a save)."""
        self.optimizer.zero_grad(set_to_none=True)


SESSION_RANK = "services.sessions.calls:SessionRank"
"""A session's rank actor."""
