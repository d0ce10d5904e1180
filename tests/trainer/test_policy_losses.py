"""The policy-loss registry (trainer/losses/registry.py) and a user's loss by class_path:
every built-in resolves by name, a user's PolicyLoss subclass resolves, anything else is
refused naming the field; PPO written as a plugin is the built-in ``ppo`` on the
objective production calls (trainer/objective.py), value and gradient, in float64."""

from __future__ import annotations

import sys
import typing

import pytest
import torch
from pydantic import ValidationError

from rollout.plugins import PluginError
from services.runtime.preflight import _check_policy_loss_class
from tests.trainer.helpers import random_train_batch
from tests.trainer.policy_loss_plugins import ClippedPPO
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.losses import POLICY_LOSSES, PolicyLoss, build_policy_loss
from trainer.losses.registry import policy_loss_class
from trainer.micro_batch import slice_for_plan
from trainer.objective import LOGGED_SUMS, TokenLogProbs, micro_batch_objective
from trainer.step_plan import plan_step
from trainer.terms import POLICY_TERM_NAMES

PLUGINS = "tests.trainer.policy_loss_plugins"
COEFS = {"kl_coef": 0.1, "entropy_coef": 0.01}


def custom(name: str, **kwargs: float) -> LossConfig:
    return LossConfig(policy_loss="custom", class_path=f"{PLUGINS}:{name}", kwargs=kwargs,
                      **COEFS)


def test_every_built_in_and_a_custom_loss_resolve() -> None:
    names = set(typing.get_args(LossConfig.model_fields["policy_loss"].annotation))
    assert names == {*POLICY_LOSSES, "custom"}  # the config offers exactly the registry
    for name, loss_class in POLICY_LOSSES.items():
        assert issubclass(loss_class, PolicyLoss)
        assert policy_loss_class(LossConfig(policy_loss=name)) is loss_class
        assert loss_class.__module__ == f"trainer.losses.{name}"  # one file each
        assert "ℓ_t" in sys.modules[loss_class.__module__].__doc__  # its formula there
    built = build_policy_loss(custom("ClippedPPO", eps=0.3))
    assert isinstance(built, ClippedPPO) and built.eps == 0.3


@pytest.mark.parametrize("name", ["not_a_class", "NotAPolicyLoss"])
def test_a_non_subclass_is_refused_naming_the_field(name: str) -> None:
    with pytest.raises(PluginError, match=r"^trainer\.loss\.class_path: .*does not subclass "
                                          r"trainer\.losses\.PolicyLoss"):
        build_policy_loss(custom(name))
    with pytest.raises(PluginError, match=r"^trainer\.loss\.class_path: "):
        _check_policy_loss_class(custom(name), load=True)  # the job's preflight


def test_kwargs_the_class_refuses_and_the_config_rules_name_their_field() -> None:
    with pytest.raises(PluginError, match=r"^trainer\.loss\.kwargs: ClippedPPO"):
        build_policy_loss(custom("ClippedPPO", clip=0.3))
    with pytest.raises(PluginError, match=r"^trainer\.loss\.class_path: .*no callable"):
        _check_policy_loss_class(custom("Missing"), load=False)  # the controller's
    for bad, field in [({"policy_loss": "custom"}, "class_path"),
                       ({"class_path": f"{PLUGINS}:ClippedPPO"}, "class_path"),
                       ({"kwargs": {"eps": 0.1}}, "kwargs"),
                       ({"policy_loss": "custom", "class_path": "losses.py"}, "class_path")]:
        with pytest.raises(ValidationError, match=rf"Value error, {field}: "):
            LossConfig(**bad)


def test_the_controller_locates_without_importing() -> None:
    sys.modules.pop(PLUGINS, None)
    _check_policy_loss_class(custom("ClippedPPO"), load=False)
    assert PLUGINS not in sys.modules


def test_gradient_of_offers_every_policy_term() -> None:
    annotation = ObjectiveConfig.model_fields["gradient_of"].annotation
    assert typing.get_args(annotation) == ("all", *POLICY_TERM_NAMES)


def _objective_run(loss: LossConfig, seed: int = 0) -> tuple[torch.Tensor, dict[str, float],
                                                             torch.Tensor, torch.Tensor]:
    """(J, the logged sums, ∇J wrt the log-probs and wrt the entropy) of one step of a
    small batch through the objective production calls, float64, one packed rank; the
    policy moved off the old one so that PPO clips."""
    batch = random_train_batch(vocab_size=50, num_prompts=4, group_size=2, seed=seed,
                               per_token=True)
    gen = torch.Generator().manual_seed(seed)
    batch = batch.with_old_log_probs(batch.rollout_log_probs
                                     + 0.1 * torch.randn(batch.loss_mask.shape, generator=gen))
    moved = 0.6 * (torch.rand(batch.loss_mask.shape, generator=gen, dtype=torch.float64) - 0.5)
    objective = ObjectiveConfig.compose(AggregationConfig(), loss, 16, 1.0)
    plan = plan_step(batch, objective, 1, 1, max_tokens_per_micro_batch=24)
    assert len(plan.micro_batches[0]) > 1  # several micro-batches add up
    total, sums, grads_lp, grads_h = torch.zeros(()), None, [], []
    for samples in plan.micro_batches[0]:
        micro = slice_for_plan(batch, plan, samples, 1, 0)
        shift = slice_for_plan(batch.with_old_log_probs(moved), plan, samples, 1, 0)
        log_probs = (micro.old_log_probs.double() + shift.old_log_probs.double()
                     ).requires_grad_(True)
        entropy = (2.0 - log_probs.detach()).requires_grad_(True)
        token = TokenLogProbs(log_probs, entropy, 0.9 * log_probs.detach() - 0.05)
        j, logged = micro_batch_objective(token, micro, loss, plan.mode_metric_names)
        j.backward()
        total = total + j.detach().double()
        sums = logged if sums is None else sums + logged
        grads_lp.append(log_probs.grad.flatten())
        grads_h.append(entropy.grad.flatten())
    named = dict(zip([*LOGGED_SUMS, *plan.mode_metric_names], sums.tolist(), strict=True))
    return total, named, torch.cat(grads_lp), torch.cat(grads_h)


def test_ppo_as_a_plugin_is_the_built_in_ppo_on_the_objective() -> None:
    built_in = _objective_run(LossConfig(**COEFS))
    plugin = _objective_run(custom("ClippedPPO", eps=0.2))
    assert built_in[1]["clipped_tokens"] > 0 and built_in[1]["kl"] != 0  # it clips; KL on
    torch.testing.assert_close(plugin[0], built_in[0], rtol=1e-13, atol=1e-15)
    assert plugin[1] == pytest.approx(built_in[1], rel=1e-13, abs=1e-15)
    torch.testing.assert_close(plugin[2], built_in[2], rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(plugin[3], built_in[3], rtol=1e-13, atol=1e-15)
    assert plugin[2].abs().sum() > 0
    other = _objective_run(custom("ClippedPPO", eps=0.05))  # the comparison can fail
    assert abs(other[1]["pg_loss"] - built_in[1]["pg_loss"]) > 1e-6
    assert not torch.allclose(other[2], built_in[2], rtol=1e-6, atol=0)
