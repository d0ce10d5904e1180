"""Advantage estimators: one file per ``advantage.type``, its formula in the docstring
(grpo, reinforce_pp, reward, distill, gae), chosen by ``registry.py``; a user's own by
``type: custom`` and ``class_path`` (docs/extending.md). The contract: base.py."""

from rollout.advantages.base import AdvantageEstimator, AdvantageInputs, per_token
from rollout.advantages.distill import Distill, distill_advantages, reverse_kl
from rollout.advantages.gae import GAE, gae, with_gae
from rollout.advantages.grpo import GRPO, grpo_advantages
from rollout.advantages.registry import (
    BUILTIN,
    build_estimator,
    compute_advantages,
    estimator_class,
    load_estimator_class,
)
from rollout.advantages.reinforce_pp import ReinforcePP, reinforce_pp_advantages
from rollout.advantages.reward import Reward
from rollout.advantages.whitening import (
    explained_variance,
    moments_mean_std,
    token_moments,
    whiten,
)

__all__ = [
    "BUILTIN", "GAE", "GRPO", "AdvantageEstimator", "AdvantageInputs", "Distill",
    "ReinforcePP", "Reward", "build_estimator", "compute_advantages", "distill_advantages",
    "estimator_class", "explained_variance", "gae", "grpo_advantages",
    "load_estimator_class", "moments_mean_std", "per_token", "reinforce_pp_advantages",
    "reverse_kl", "token_moments", "whiten", "with_gae",
]
