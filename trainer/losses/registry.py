"""The policy losses by name (``trainer.loss.policy_loss``), and a user's own by
``trainer.loss.class_path`` (``policy_loss: custom``).

A user's class is imported only where it runs (the job's preflight and the trainer ranks)
through rollout/plugins.py, the one loader of ``module:attr`` paths; the controller only
locates it (services/runtime/preflight.py). It must subclass :class:`PolicyLoss`, so a config can
never make the ranks call an arbitrary callable (``subprocess:Popen`` with ``kwargs``).
"""

from __future__ import annotations

from rollout.plugins import PluginError, load_subclass
from trainer.config import (
    CUSTOM_POLICY_LOSS,
    POLICY_LOSS_CLASS_PATH_FIELD,
    POLICY_LOSS_KWARGS_FIELD,
    LossConfig,
)
from trainer.losses.base import PolicyLoss
from trainer.losses.cispo import CISPO
from trainer.losses.cross_entropy import CrossEntropy
from trainer.losses.gspo import GSPO
from trainer.losses.importance_sampling import ImportanceSampling
from trainer.losses.ppo import PPO

POLICY_LOSSES: dict[str, type[PolicyLoss]] = {
    "ppo": PPO,
    "gspo": GSPO,
    "cispo": CISPO,
    "importance_sampling": ImportanceSampling,
    "cross_entropy": CrossEntropy,
}
"""Built-in policy losses, one file each in trainer/losses/, by ``policy_loss`` name."""


def load_policy_loss_class(path: str, field: str = POLICY_LOSS_CLASS_PATH_FIELD
                           ) -> type[PolicyLoss]:
    """The class ``path`` names, imported, a PolicyLoss."""
    return load_subclass(path, field, PolicyLoss, "trainer.losses",
                         "a policy loss must (class MyLoss(PolicyLoss), docs/extending.md)")


def policy_loss_class(config: LossConfig) -> type[PolicyLoss]:
    """The class of ``config.policy_loss``: a built-in's, or the user's ``class_path``."""
    if config.policy_loss == CUSTOM_POLICY_LOSS:
        assert config.class_path is not None, "LossConfig validates class_path for custom"
        return load_policy_loss_class(config.class_path)
    return POLICY_LOSSES[config.policy_loss]


def build_policy_loss(config: LossConfig) -> PolicyLoss:
    """The configured policy loss, built with ``kwargs`` (a user's class only); a
    constructor that refuses them is a PluginError naming ``trainer.loss.kwargs``."""
    loss_class = policy_loss_class(config)
    try:
        return loss_class(config, **config.kwargs)
    except TypeError as err:
        raise PluginError(f"{POLICY_LOSS_KWARGS_FIELD}: {loss_class.__name__}(config, **kwargs) "
                          f"failed: {err}") from err
