"""The driver's part of a rollout's advantages: what needs the trainer's actors.

    RolloutBatch from the manager (its estimator's advantages, unless it needs the critic)
        │  KL in the reward: π_old (trainer.log_probs, or the rollout's) and π_ref
        │  (trainer.reference_log_probs) ──► β·k1 [N, S], rollout/kl_reward.py; β moves
        │  the critic's values V [N, S] (the estimator needs_critic)
        ▼
    estimator.apply(batch, values=…, kl_penalty=…) ──► A [N, S]; critic/*, kl/* metrics

The estimator declares what it reads (rollout/advantages/base.py); the driver hands it
what it declared and, with ``trainer.loss.kl_placement: reward``, the penalty, which its
inputs take off the rewards. The manager leaves such an estimator to the driver
(``estimator_in_driver``, set by the gang) and adds only a teacher's term; ``apply`` adds
the estimator's advantages to it. What the batch itself carries the estimator's inputs
read there: GAE with ``bootstrap_truncated`` declares ``needs_truncation`` and reads the
batch's ``truncated`` flags (responses cut at the length limit), so the driver, the
verifier's ``with_gae`` and a test all bootstrap the same samples.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollout.advantages import AdvantageEstimator
from rollout.batch import RolloutBatch
from rollout.confined import read_inside
from rollout.kl_reward import KLController, kl_per_token
from trainer.config import LossConfig

KL_CONTROLLER_STATE = "kl_controller.json"
"""The controller's state in a checkpoint folder, beside driver_state.json."""


@dataclass
class KLInReward:
    """β·k1 of each rollout (rollout/kl_reward.py) and β's controller, checkpointed."""

    controller: KLController
    old_from_trainer: bool
    """π_old is the trainer's log-probs before the update (``old_log_probs: trainer``),
    else the engine's."""

    @classmethod
    def of(cls, loss: LossConfig) -> KLInReward | None:
        """The KL in the reward of ``loss``; None with the KL in the loss."""
        if loss.kl_placement != "reward":
            return None
        settings = loss.kl_controller
        return cls(KLController(loss.kl_coef, settings.type == "adaptive", settings.target,
                                settings.horizon), loss.old_log_probs == "trainer")

    def penalty(self, batch: RolloutBatch, log_probs: Callable[[RolloutBatch], Any],
                reference_log_probs: Callable[[RolloutBatch], Any]
                ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """(β·k1 [N, S] float64 with this step's β, the trainer's π_old when it computed
        it, ``kl/beta`` (that β) and ``kl/mean`` (e)); β then moves by e over N."""
        old = log_probs(batch) if self.old_from_trainer else None
        k1 = kl_per_token(batch.rollout_log_probs if old is None else old,
                          reference_log_probs(batch), batch.loss_mask)
        beta, mean_kl = self.controller.beta, float(k1.sum(dim=-1).mean())
        self.controller.update(mean_kl, batch.num_samples)
        return beta * k1, old, {"kl/beta": beta, "kl/mean": mean_kl}

    def save(self, folder: Path) -> None:
        (folder / KL_CONTROLLER_STATE).write_text(json.dumps(self.controller.state_dict()))

    def load(self, folder: Path, log: Callable[[str], None]) -> None:
        """β as checkpoint ``folder`` holds it (read confined to the folder); one written
        without the KL in the reward (resumed with --force) leaves β at kl_coef."""
        if not (folder / KL_CONTROLLER_STATE).is_file():
            log(f"{folder} holds no KL controller: β starts at kl_coef")
            return
        self.controller.load_state_dict(json.loads(read_inside(folder, KL_CONTROLLER_STATE)))


def driver_advantages(batch: RolloutBatch, estimator: AdvantageEstimator,
                      kl: KLInReward | None, trainer: Any, critic: Any,
                      several_updates: bool) -> RolloutBatch | None:
    """``batch`` with the advantages the driver computes (the critic's values, the KL in
    the reward), or None where the manager's stand as they are. ``trainer``: the policy's
    group (log_probs, reference_log_probs); ``critic``: the critic's; ``several_updates``:
    the rollout trains in more than one optimizer step, so the trainer's π_old computed
    for the KL is the batch's old log-probs too (with one, the ratio stays exactly 1)."""
    scored: dict[str, torch.Tensor] = {}
    metadata: dict[str, float] = {}
    if kl is not None and batch.num_valid_tokens:  # a step with none is skipped
        penalty, old, metadata = kl.penalty(batch, trainer.log_probs,
                                            trainer.reference_log_probs)
        if old is not None and several_updates:
            batch = batch.with_old_log_probs(old)
        if estimator.uses_rewards:  # a distilling estimator trains on no reward
            scored["kl_penalty"] = penalty
    if estimator.needs_critic:
        assert critic is not None  # preflight: it needs critic.enabled
        scored["values"] = critic.values(batch)
    if not scored and not metadata:
        return None
    batch = estimator.apply(batch, **scored) if scored else batch
    return dataclasses.replace(batch, metadata={**batch.metadata, **metadata})

