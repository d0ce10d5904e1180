"""``trainer.loss.old_log_probs: proximal`` in a job config: refused naming the field for a
loss without an old policy, coherent with ``rollout.async_steps`` (the async rule does not
add its own tis_cap: proximal brings the same weight and says so), and a resolved config
read back unchanged and silent."""

from __future__ import annotations

import pytest

from services.config.errors import ConfigError, ConfigProblem
from services.config.job import ASYNC_TIS_CAP, JobConfig, parse_job_config


def problems_of(text: str, overrides: list[str] | None = None) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(text, overrides)
    return caught.value.problems


@pytest.mark.parametrize(("loss", "field", "message"), [
    ("policy_loss: importance_sampling", "trainer.loss.old_log_probs",
     "needs a loss with an old policy (ppo, gspo, cispo), but policy_loss=importance_sampling"),
    ("policy_loss: cross_entropy", "trainer.loss.old_log_probs",
     "but policy_loss=cross_entropy"),
    ("tis_cap: null", "trainer.loss.tis_cap", "proximal always weights each token"),
])
def test_proximal_is_refused_naming_the_field(loss: str, field: str, message: str) -> None:
    (problem,) = problems_of(f"trainer: {{loss: {{old_log_probs: proximal, {loss}}}}}\n")
    assert problem.field == field and message in problem.message, problem


def test_proximal_is_refused_through_set_as_well() -> None:
    (problem,) = problems_of("trainer: {loss: {policy_loss: importance_sampling}}\n",
                             ["trainer.loss.old_log_probs=proximal"])
    assert problem.field == "trainer.loss.old_log_probs"


@pytest.mark.parametrize("async_steps", [0, 2])
def test_proximal_brings_its_own_weight_under_async_and_says_so(async_steps: int) -> None:
    config = parse_job_config(f"rollout: {{async_steps: {async_steps}}}\n"
                              "trainer: {loss: {old_log_probs: proximal}}\n")
    loss = config.trainer.loss
    assert loss.old_log_probs == "trainer" and loss.tis_cap is None  # no async tis_cap
    assert loss.correction is not None
    assert (loss.correction.level, loss.correction.mode, loss.correction.high) == (
        "token", "truncate", ASYNC_TIS_CAP)  # the async default's weight, one spelling
    (said,) = [w for w in config.warnings() if w.field == "trainer.loss.old_log_probs"]
    assert "resolved to old_log_probs: trainer" in said.message
    assert "high: 2}" in said.message
    assert not [w for w in config.warnings() if w.field == "trainer.loss.tis_cap"]
    # The resolved config (the controller's config_resolved) read back: same, silent.
    again = JobConfig.model_validate_json(config.model_dump_json())
    assert again.model_dump() == config.model_dump() and again.warnings() == []


def test_proximal_keeps_the_users_correction() -> None:
    config = parse_job_config("rollout: {async_steps: 1}\n"
                              "trainer: {loss: {old_log_probs: proximal, rollout_correction: "
                              "{mode: mask, low: 0.0, high: 5.0}}}\n")
    correction = config.trainer.loss.correction
    assert correction is not None and (correction.mode, correction.high) == ("mask", 5.0)
    (said,) = config.warnings()
    assert said.field == "trainer.loss.old_log_probs" and "mode: mask, high: 5}" in said.message
