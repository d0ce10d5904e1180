r"""Per-token loss terms: each returns ℓ_it; trainer/aggregation.py turns them into J.

One file per policy loss, its formula in its docstring, chosen by
``trainer.loss.policy_loss`` (registry.py; a user's own by ``class_path``):

    ppo.py                  the clipped surrogate, clip-higher, dual clip
    gspo.py                 PPO's clip on the sequence ratio exp(mean_t log π_θ/π_old)
    cispo.py                REINFORCE weighted by sg(min(π_θ/π_old, 1 + ε_high))
    importance_sampling.py  REINFORCE weighted by π_θ / π_rollout
    cross_entropy.py        −log π_θ(a_t) (SFT)
    base.py                 the PolicyLoss interface, NaN-safe ratios, per-sample sums
    rollout_correction.py   the off-policy correction of π_old/π_rollout (tis_cap, IcePop),
                            and decoupled PPO's behaviour weight (old_log_probs: proximal)
    kl.py                   the KL penalty to the reference (k1, k2, k3, low_var_kl)
    log_probs.py            log-probs and entropy of π_T = softmax(z / T)

Which terms enter the objective and how they are signed: trainer/terms.py.
"""

from __future__ import annotations

import torch

from trainer.config import LossConfig
from trainer.losses.base import (
    MAX_LOG_RATIO,
    PolicyLoss,
    PolicyLossInputs,
    PolicyLossTerms,
    safe_exp_log_ratio,
)
from trainer.losses.kl import kl_penalty
from trainer.losses.log_probs import (
    entropy_from_log_probs,
    entropy_from_logits,
    log_probs_and_entropy,
    loss_positions,
    spread,
    tempered_log_softmax,
    token_log_probs,
)
from trainer.losses.registry import POLICY_LOSSES, build_policy_loss, load_policy_loss_class
from trainer.losses.rollout_correction import corrected_terms

__all__ = ["MAX_LOG_RATIO", "POLICY_LOSSES", "PolicyLoss", "PolicyLossInputs",
           "PolicyLossTerms", "build_policy_loss", "entropy_from_log_probs",
           "entropy_from_logits", "kl_penalty", "load_policy_loss_class",
           "log_probs_and_entropy", "loss_positions", "policy_gradient_loss",
           "safe_exp_log_ratio", "spread", "tempered_log_softmax", "token_log_probs"]


def policy_gradient_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config: LossConfig,
    loss_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None = None,
) -> PolicyLossTerms:
    """The pg term per token of ``config``'s policy loss, its rollout correction applied
    (one process, a row is a sample); 0 where masked."""
    terms, _ = corrected_terms(build_policy_loss(config), PolicyLossInputs(
        log_probs, old_log_probs, advantages, loss_mask, rollout_log_probs))
    return terms
