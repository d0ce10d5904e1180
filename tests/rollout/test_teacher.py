"""On-policy distillation's rollout side: the teacher's log-probs of the sampled tokens are
aligned with the batch (a teacher that is the policy itself reproduces the engine's own
log-probs, so its advantage is 0), the per-token advantage is coef · (log π_teacher −
log π_old) on weighted tokens added to the task's, and the teacher actors of a real
manager split the rollout between them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.advantages import compute_advantages, distill_advantages, reverse_kl
from rollout.config import (
    AdvantageConfig,
    RolloutConfig,
    SamplingConfig,
    SyntheticDatasetConfig,
    TeacherConfig,
    TorchEngineConfig,
)
from rollout.manager import RolloutManager
from rollout.teacher import response_log_probs
from services.runtime.gang import start_rollout_actors
from tests.trainer.helpers import sampled_train_batch


def test_the_policy_as_its_own_teacher_gives_the_engines_log_probs(tiny_model_path: str
                                                                   ) -> None:
    """Position t holds the log-prob of token t at the sampling temperature, 0 off the
    response: exactly what the engine reported while sampling (a shift by one, a missing
    temperature or a prompt token scored would differ)."""
    batch = sampled_train_batch(tiny_model_path, temperature=0.7, num_prompts=3,
                                group_size=2, max_new_tokens=6)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for batch_size in (1, 4):  # rows of several lengths in one forward, and one by one
        scored = response_log_probs(model, batch.input_ids, batch.prompt_lengths,
                                    batch.response_lengths, 0.7, batch_size)
        torch.testing.assert_close(scored, batch.rollout_log_probs, rtol=0, atol=1e-5)
    assert bool((scored[batch.loss_mask == 0] == 0).all())
    advantages = distill_advantages(scored, batch.rollout_log_probs, batch.loss_mask, 2.0)
    assert float(advantages.abs().max()) < 1e-4
    assert abs(reverse_kl(scored, batch.rollout_log_probs, batch.loss_mask)) < 1e-5


def test_the_distillation_advantage_and_its_reverse_kl() -> None:
    teacher = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, 0.0, -3.0, -1.0]])
    old = torch.tensor([[0.0, -1.5, -1.0, -0.5], [0.0, 0.0, -1.0, -4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.5, 1.0]])
    advantages = distill_advantages(teacher, old, mask, 2.0)
    assert advantages.tolist() == [[0.0, 1.0, -2.0, 0.0], [0.0, 0.0, -4.0, 6.0]]
    # Σ m (old − teacher) / Σ m = (−0.5 + 1 + 0.5·2 − 3) / (1 + 1 + 0.5 + 1)
    assert reverse_kl(teacher, old, mask) == pytest.approx(-1.5 / 3.5)
    assert reverse_kl(teacher, old, torch.zeros_like(mask)) == 0.0


def _manager(model_path: str, teacher: str, advantage: AdvantageConfig,
             with_teacher: bool) -> RolloutManager:
    config = RolloutConfig(
        model=model_path, dataset=SyntheticDatasetConfig(task="copy", num_prompts=16),
        engine=TorchEngineConfig(num_threads=1), n_samples_per_prompt=4,
        global_batch_size=12, sampling=SamplingConfig(temperature=0.9, max_new_tokens=6),
        advantage=advantage,
        teacher=(TeacherConfig(model=teacher, coef=0.5, num_actors=2, num_cpus=0)
                 if with_teacher else None))
    actors = start_rollout_actors(config, model_path)  # the teachers too, when it has one
    return RolloutManager(config, model_path, engines=actors.engines, owns_engines=True,
                          teachers=actors.teachers, reward_actors=actors.reward_actors)


@pytest.mark.slow  # two managers, their engines and three teacher actors on Ray
def test_a_managers_teachers_add_their_advantage_to_the_tasks_and_distill_replaces_it(
        ray_cluster: None, tiny_model_path: str, other_tiny_model_path: str) -> None:
    """Two teacher actors (another model: seed 1) score a rollout of 12 samples between
    them; beside GRPO the advantage is GRPO's plus 0.5 · (log π_teacher − log π_old),
    computed here from the teacher model in this process; type distill (one teacher
    actor) keeps only the teacher's. The same seed samples the same rollout under both."""
    teacher_model = AutoModelForCausalLM.from_pretrained(other_tiny_model_path,
                                                         dtype=torch.float32)
    grpo = _manager(tiny_model_path, other_tiny_model_path, AdvantageConfig(), True)
    distill = _manager(tiny_model_path, other_tiny_model_path,
                       AdvantageConfig(type="distill", teacher=other_tiny_model_path,
                                       coef=0.5), False)
    try:
        handed = [list(grpo.teachers), list(distill.teachers)]  # the gang's, started first
        assert [len(teachers) for teachers in handed] == [2, 1]
        with_teacher, distilled = grpo.generate_batch(0), distill.generate_batch(0)
        assert [grpo.teachers, distill.teachers] == handed  # used, none started by them
    finally:
        for manager in (grpo, distill):
            manager.shutdown()
    assert torch.equal(with_teacher.input_ids, distilled.input_ids)
    assert torch.equal(distilled.rewards, with_teacher.rewards)  # scored, not trained
    batch = with_teacher
    scored = response_log_probs(teacher_model, batch.input_ids, batch.prompt_lengths,
                                batch.response_lengths, 0.9, 32)
    expected = 0.5 * (scored - batch.rollout_log_probs) * (batch.loss_mask > 0)
    assert float(expected.abs().max()) > 0.1  # another model: a real signal
    task = compute_advantages(batch.rewards, batch.group_index, AdvantageConfig())
    position = torch.arange(batch.input_ids.shape[1])[None, :]
    response = (position >= batch.prompt_lengths[:, None]) & (
        position < batch.sequence_lengths[:, None])
    torch.testing.assert_close(with_teacher.advantages,
                               torch.where(response, task[:, None], 0.0) + expected,
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(distilled.advantages, expected, rtol=0, atol=1e-5)
    kl = with_teacher.metadata["distill/reverse_kl"]
    assert kl == pytest.approx(reverse_kl(scored, batch.rollout_log_probs, batch.loss_mask),
                               abs=1e-6)
