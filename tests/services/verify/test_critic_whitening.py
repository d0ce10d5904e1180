"""The verifier's critic part (services/verify/critic.py) runs production's GAE and
whitening, not a copy: each layout's batch equals the driver's ``with_gae`` of the whole
rollout (the ranks' moments sum to the rollout's), a bug planted in production's
whitening moves the verifier's batches with it, and the planted ``local_whitening``
moves them away from production's."""

from __future__ import annotations

import importlib
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

from rollout.advantages.gae import GAE, with_gae
from services.config.job import load_job_config
from services.verify.critic import critic_check
from tests.trainer.helpers import random_train_batch
from trainer.planted import PlantedError
from trainer.verify import Layout

PPO = Path(__file__).resolve().parents[3] / "configs" / "demo-ppo.yaml"
LAYOUTS = [Layout(1, 1, packed=False), Layout(2, 1, packed=True), Layout(1, 2, packed=True),
           Layout(3, 1, packed=False)]


def _job_and_batch() -> tuple[object, object, torch.Tensor]:
    job = load_job_config(PPO, ["trainer.max_tokens_per_micro_batch=24",
                                "rollout.advantage.lam=0.7"])
    batch = random_train_batch(vocab_size=40, num_prompts=6, group_size=2, seed=3,
                               per_token=True)
    values = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(4))
    return job, batch, values


def test_each_layout_gets_the_drivers_advantages() -> None:
    job, batch, values = _job_and_batch()
    assert job.rollout.advantage.normalize  # gae's default
    check = critic_check(job, "unused-model-path", batch, {})
    driver = with_gae(batch, values, job.rollout.advantage)
    for layout in LAYOUTS:
        got = check.batch_for_layout(layout, values)
        torch.testing.assert_close(got.advantages, driver.advantages, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.returns, driver.returns, rtol=0, atol=0)


def test_a_bug_in_productions_whitening_reaches_the_verifier(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whitening that divides by σ + 1 instead of σ + ε (a wrong eps passed on): the
    verifier's batches move exactly as the driver's."""
    job, batch, values = _job_and_batch()
    check = critic_check(job, "unused-model-path", batch, {})
    before = check.batch_for_layout(LAYOUTS[1], values).advantages
    module = importlib.import_module("rollout.advantages.gae")
    source = textwrap.dedent(inspect.getsource(GAE._whitened))
    line = "return whiten_over_ranks(advantages, mask, moments, self.eps)"
    assert source.count(line) == 1
    namespace = dict(vars(module))
    exec(compile(source.replace(line, line.replace("self.eps", "1.0")), "<planted>",
                 "exec", flags=__import__("__future__").annotations.compiler_flag,
                 dont_inherit=True), namespace)
    monkeypatch.setattr(GAE, "_whitened", namespace["_whitened"])
    driver = with_gae(batch, values, job.rollout.advantage).advantages
    after = check.batch_for_layout(LAYOUTS[1], values).advantages
    assert (after - before).abs().max() > 1e-2  # the bug shows in the verifier ...
    torch.testing.assert_close(after, driver, rtol=1e-6, atol=1e-6)  # ... as in production


def test_planted_local_whitening_leaves_productions_path() -> None:
    job, batch, values = _job_and_batch()
    layout = LAYOUTS[1]
    planted = critic_check(job, "unused-model-path", batch,
                           {str(layout): frozenset({PlantedError.LOCAL_WHITENING})})
    driver = with_gae(batch, values, job.rollout.advantage)
    got = planted.batch_for_layout(layout, values)
    assert (got.advantages - driver.advantages).abs().max() > 1e-3
    torch.testing.assert_close(got.returns, driver.returns, rtol=0, atol=0)
