"""A user's own advantage estimator in a real job: Dr. GRPO written apart
(tests/rollout/toy_estimators.py) and named by ``class_path`` trains exactly what the
built-in ``{type: grpo, normalize_std: false}`` does; a class that is no
AdvantageEstimator is refused by the job's preflight, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config.job import ConfigError, load_job_config
from services.driver.loop import run_job
from services.runtime.preflight import preflight
from tests.services.driver.clean_run import ROOT, CleanRun, assert_same_training, rows

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Jobs of one shape one after another: each may take the gang the last one left."""

TINY_JOB = ["num_steps=2", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=8",
            "rollout.global_batch_size=16", "trainer.dp_size=1", "eval.enabled=false",
            "trainer.optimizer.schedule=constant", "checkpoint_every=0",
            # graded rewards: every group has spread, and a std far from 1
            "rollout.reward={type: custom, custom_function: "
            "'tests.rollout.reward_fns:length_reward'}"]
DR_GRPO = "tests.rollout.toy_estimators:DrGRPO"


def _config(advantage: str) -> object:
    return load_job_config(ROOT / "configs" / "demo.yaml",
                           [*TINY_JOB, f"rollout.advantage={advantage}"])


def test_a_users_dr_grpo_trains_what_the_builtin_does(ray_cluster: None,
                                                      tmp_path: Path) -> None:
    builtin = tmp_path / "builtin"
    history = run_job(_config("{type: grpo, normalize_std: false}"), builtin,
                      log=lambda *_: None)
    # Groups with reward spread: the advantages are not all 0, and Dr. GRPO's (no std
    # division) are not GRPO's.
    assert all(row["reward/groups_with_signal"] > 0 and row["reward/std"] > 1
               for row in history), history
    custom = tmp_path / "custom"
    run_job(_config(f"{{type: custom, class_path: '{DR_GRPO}', kwargs: {{scale: 1.0}}}}"),
            custom, log=lambda *_: None)
    assert_same_training(custom, CleanRun(builtin, history))
    assert len(rows(custom / "updates.jsonl")) == 2


@pytest.mark.parametrize(("name", "said"), [
    ("NotAnEstimator", "is a class that does not subclass "
                       "rollout.advantages.AdvantageEstimator"),
    ("NeedsTeacher", "needs a teacher's log-probs: set rollout.teacher.model")])
def test_the_jobs_preflight_refuses_a_class_it_cannot_use_naming_the_field(
        name: str, said: str) -> None:
    config = _config(f"{{type: custom, class_path: 'tests.rollout.toy_estimators:{name}'}}")
    preflight(config)  # the controller's check locates the class, never imports it
    with pytest.raises(ConfigError) as err:
        preflight(config, load_user_code=True)
    (problem,) = err.value.problems
    assert problem.field == "rollout.advantage.class_path"
    assert said in problem.message
