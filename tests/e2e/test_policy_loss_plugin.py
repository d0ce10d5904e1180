"""A user's own policy loss in a real job: PPO's clipped surrogate written apart
(tests/trainer/policy_loss_plugins.py) and named by ``trainer.loss.class_path`` trains
exactly what the built-in ``ppo`` does, with clipping active; a class that is no
PolicyLoss is refused by the job's preflight, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config.job import ConfigError, load_job_config
from services.driver.loop import run_job
from services.runtime.preflight import preflight
from tests.services.driver.clean_run import ROOT, CleanRun, assert_same_training, rows

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Jobs of one shape one after another: each may take the gang the last one left."""

EPS = 0.02
TINY_JOB = ["num_steps=1", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=8",
            "rollout.global_batch_size=16", "trainer.ppo_epochs=2", "trainer.dp_size=1",
            "eval.enabled=false", "trainer.optimizer.lr=2.0e-3",
            "trainer.optimizer.schedule=constant", "checkpoint_every=0",
            f"trainer.loss.eps_clip={EPS}"]
"""One rollout step, 4 optimizer steps (2 mini-batches × 2 epochs): after the first the
old policy differs from the trained one, and a narrow clip range makes the clip act."""
PLUGINS = "tests.trainer.policy_loss_plugins"


def _config(*custom: str) -> object:
    return load_job_config(ROOT / "configs" / "demo.yaml", [*TINY_JOB, *custom])


def _custom(name: str) -> list[str]:
    return ["trainer.loss.policy_loss=custom", f"trainer.loss.class_path={PLUGINS}:{name}"]


def test_a_users_ppo_trains_what_the_builtin_does(ray_cluster: None, tmp_path: Path) -> None:
    builtin = tmp_path / "builtin"
    history = run_job(_config(), builtin, log=lambda *_: None)
    updates = [row["metrics"] for row in rows(builtin / "updates.jsonl")]
    assert len(updates) == 4 and max(u["clip_fraction"] for u in updates) > 0, updates
    assert any(u["pg_loss"] != 0 for u in updates), updates  # the groups have reward spread
    custom = tmp_path / "custom"
    run_job(_config(*_custom("ClippedPPO"), f"trainer.loss.kwargs={{eps: {EPS}}}"), custom,
            log=lambda *_: None)
    assert_same_training(custom, CleanRun(builtin, history))


def test_the_jobs_preflight_refuses_a_class_that_is_no_policy_loss() -> None:
    config = _config(*_custom("NotAPolicyLoss"))
    preflight(config)  # the controller's check locates the class, never imports it
    with pytest.raises(ConfigError) as err:
        preflight(config, load_user_code=True)
    (problem,) = err.value.problems
    assert problem.field == "trainer.loss.class_path"
    assert "does not subclass trainer.losses.PolicyLoss" in problem.message
