"""A training session's group of ranks (services/sessions/runtime.py): the policy's
``TrainerGroup`` running :class:`SessionRank` actors, with the session's verbs: a call's
gradients accumulated as a transaction, then one step when the session asks for it.
"""

from __future__ import annotations

from typing import Any

import ray

from rollout.batch import RolloutBatch
from services.sessions.calls import SESSION_RANK, SessionRank
from trainer.config import LossConfig, ObjectiveConfig, TrainerConfig
from trainer.group import TrainerGroup
from trainer.step_plan import StepPlan


class CallUndone(RuntimeError):
    """A session call failed on some rank; every rank's gradient is as before it."""


class GradientsLost(RuntimeError):
    """A session call failed and the ranks' gradients could not be restored: what the
    earlier calls of the step accumulated is lost."""


def _first_line(err: Exception) -> str:
    """An error in one line: a rank's exception (Ray's remote traceback cut), its type
    when it says nothing."""
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause if isinstance(err.cause, Exception) else None
        if cause is not None:
            return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _failed_rank(refs: list[ray.ObjectRef]) -> str | None:
    """"trainer rank r failed: <its error>" for the first rank whose call is over and
    failed; None when none is (yet)."""
    for rank, ref in enumerate(refs):
        done, _ = ray.wait([ref], timeout=0)
        if done:
            try:
                ray.get(ref)
            except Exception as err:
                return f"trainer rank {rank} failed: {_first_line(err)}"
    return None


class SessionGroup(TrainerGroup):
    """The policy's group of a session: its ranks are :class:`SessionRank` actors."""

    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 total_steps: int, **kwargs: Any) -> None:
        super().__init__(config, objective, model_path, total_steps, worker=SESSION_RANK,
                         **kwargs)

    def accumulate(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Backpropagate ``plan``'s weighted sums into the gradients (no update), as a
        transaction (services/sessions/calls.py): if any rank fails, every rank's gradient
        is put back as it was (``CallUndone``), or, when the ranks cannot do even that
        within ``call_timeout_s``, ``GradientsLost``."""
        verb = SessionRank.forward_backward_call
        batch_ref, plan_ref = ray.put(batch), ray.put(plan)
        refs = self._start(verb, batch_ref, plan_ref)
        try:
            self._wait(verb, refs)
            sums = ray.get(refs[0])
        except Exception as err:
            cause = _failed_rank(refs) or _first_line(err)
            try:  # queued behind each rank's call: it runs once that call is over
                self._call(SessionRank.restore_call)
            except Exception as undo:
                raise GradientsLost(f"{cause}; the ranks could not restore their "
                                    f"gradients ({_first_line(undo)})") from err
            raise CallUndone(f"{cause}; every rank's gradient is restored to before "
                             "the call") from err
        try:
            self._call(SessionRank.commit_call)
        except Exception as err:
            raise GradientsLost(f"committing the call's gradients failed: "
                                f"{_first_line(err)}") from err
        return sums

    def evaluate(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """The sums ``accumulate`` would return, without a gradient."""
        return self._call(SessionRank.forward_only, ray.put(batch), ray.put(plan))[0]

    def apply_gradients(self, scale: float, adam: dict[str, Any], grad_clip: float | None
                        ) -> dict[str, float]:
        return self._call(SessionRank.apply_gradients, scale, adam, grad_clip)[0]

    def discard_gradients(self) -> None:
        self._call(SessionRank.discard_gradients)

    def use_loss(self, loss: LossConfig) -> None:
        self._call(SessionRank.use_loss, loss)
