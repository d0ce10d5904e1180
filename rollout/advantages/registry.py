"""``advantage.type`` → the estimator class, and ``type: custom``'s ``class_path``.

A built-in is constructed with its config's own settings; a user's class, imported in the
job only (rollout/plugins.py: the controller locates it without running it), with
``advantage.kwargs``, and must subclass :class:`AdvantageEstimator`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rollout.advantages.base import AdvantageEstimator, AdvantageInputs
from rollout.advantages.distill import Distill
from rollout.advantages.gae import GAE
from rollout.advantages.grpo import GRPO
from rollout.advantages.reinforce_pp import ReinforcePP
from rollout.advantages.reward import Reward
from rollout.plugins import load_subclass

if TYPE_CHECKING:
    from rollout.config import AdvantageConfig

BUILTIN: dict[str, tuple[type[AdvantageEstimator], tuple[str, ...]]] = {
    "grpo": (GRPO, ("normalize_std", "eps")),
    "reinforce_pp": (ReinforcePP, ("eps",)),
    "reward": (Reward, ()),
    "distill": (Distill, ("coef",)),
    "gae": (GAE, ("gamma", "lam", "critic_lam", "normalize", "eps", "bootstrap_truncated")),
}
"""Each built-in type's class and the AdvantageConfig fields it is constructed with."""
CLASS_PATH_FIELD = "rollout.advantage.class_path"


def load_estimator_class(path: str, field: str = CLASS_PATH_FIELD
                         ) -> type[AdvantageEstimator]:
    """The class ``path`` names, imported (in the job only), an AdvantageEstimator."""
    return load_subclass(path, field, AdvantageEstimator, "rollout.advantages",
                         "an estimator must (class MyEstimator(AdvantageEstimator), "
                         "docs/extending.md)")


def estimator_class(config: AdvantageConfig) -> type[AdvantageEstimator]:
    """The class of ``config`` (a custom one imported): its needs are class attributes."""
    if config.type == "custom":
        assert config.class_path is not None  # AdvantageConfig's rule
        return load_estimator_class(config.class_path)
    return BUILTIN[config.type][0]


def build_estimator(config: AdvantageConfig) -> AdvantageEstimator:
    """The estimator ``config`` names, constructed with its settings; a custom class
    that refuses ``kwargs`` is a ValueError naming ``rollout.advantage.kwargs``."""
    cls, kwargs = estimator_class(config), estimator_kwargs(config)
    if config.type != "custom":
        return cls(**kwargs)
    try:
        return cls(**kwargs)
    except TypeError as err:  # an unknown or missing keyword: the user's to fix
        raise ValueError(f"rollout.advantage.kwargs: {config.class_path}: {err}") from err


def compute_advantages(rewards: torch.Tensor, group_index: torch.Tensor,
                       config: AdvantageConfig) -> torch.Tensor:
    """Per-sample advantages [N] of an estimator that reads rewards and groups only; 0 for
    one that needs a critic's values or a teacher's log-probs (they work per token)."""
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index "
                         f"{tuple(group_index.shape)} must both have shape [N]")
    estimator = build_estimator(config)
    if estimator.needs_critic or estimator.needs_teacher:
        return torch.zeros_like(rewards, dtype=torch.float32)
    one_token = torch.ones(len(rewards), 1)  # each sample as a response of one token
    inputs = AdvantageInputs(
        rewards=rewards.to(torch.float32), group_index=group_index, loss_mask=one_token,
        log_probs=torch.zeros_like(one_token),
        token_rewards=rewards.to(torch.float64)[:, None]
        if estimator.needs_token_rewards else None)
    return estimator.checked(estimator(inputs), one_token)[:, 0]


def estimator_kwargs(config: AdvantageConfig) -> dict[str, Any]:
    """The keyword arguments ``config``'s estimator is constructed with."""
    if config.type == "custom":
        return dict(config.kwargs)
    return {name: getattr(config, name) for name in BUILTIN[config.type][1]}
