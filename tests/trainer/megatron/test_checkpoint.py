"""Checkpoints are HF folders plus HF-named optimizer state, independent of backend and
TP size: a Megatron TP=2 run resumes on torch FSDP2 with the same next step, and the torch
run's checkpoint resumes on Megatron at TP=1 with the same next step (AdamW, clipping
and warm-up on, so moments, step counts and the schedule must all survive)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from transformers import AutoModelForCausalLM

from tests.trainer.helpers import random_train_batch
from tests.trainer.megatron.helpers import (
    WIDE_VOCAB,
    create_wide_vocab_checkpoint,
    max_relative_difference,
    objective_for,
)
from trainer.config import OptimizerConfig, TrainerConfig
from trainer.group import TrainerGroup

pytest.importorskip("megatron.core")


def _without_k_bias(weights: dict) -> dict:
    """k_proj's bias has an exactly zero gradient (it shifts every attention logit of a
    query equally); Adam turns its rounding noise into lr-sized steps, so skip it."""
    return {k: v for k, v in weights.items() if not k.endswith("k_proj.bias")}


def _run(config: TrainerConfig, model_path: str, batches: list, load: str | None = None,
         save: str | None = None) -> list[tuple[dict[str, float], dict]]:
    """Optionally resume, then train on each batch (saving after the first); the metrics
    and weights after every step."""
    group = TrainerGroup(config, objective_for(config), model_path, total_steps=4)
    try:
        if load:
            group.load_checkpoint(load)
        steps = []
        for i, batch in enumerate(batches):
            steps.append((group.train(batch), ray.get(group.async_export_weights())))
            if save and i == 0:
                group.save_checkpoint(save)
        return steps
    finally:
        group.shutdown()


def _assert_same_step(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    (metrics, weights), (expected_metrics, expected_weights) = got, expected
    assert metrics["lr"] == expected_metrics["lr"]
    assert abs(metrics["grad_norm"] / expected_metrics["grad_norm"] - 1) < 1e-4
    difference = max_relative_difference(_without_k_bias(weights),
                                         _without_k_bias(expected_weights))
    assert difference < 1e-4


@pytest.mark.slow
def test_checkpoints_move_between_backends_and_tp_sizes(ray_cluster: None,
                                                        tmp_path: Path) -> None:
    model_path = create_wide_vocab_checkpoint(tmp_path / "tiny", seed=0)  # spans both TP ranks
    batches = [random_train_batch(WIDE_VOCAB, seed=s, first_group=3 * s) for s in range(3)]
    megatron = TrainerConfig(backend="megatron", tp_size=2, max_tokens_per_micro_batch=20,
                             optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.01,
                                                       warmup_steps=2))
    torch_backend = megatron.model_copy(update={"backend": "fsdp", "tp_size": 1})
    from_megatron, from_torch = str(tmp_path / "megatron_step1"), str(tmp_path / "torch_step2")

    megatron_steps = _run(megatron, model_path, batches[:2], save=from_megatron)
    _, info = AutoModelForCausalLM.from_pretrained(f"{from_megatron}/model",
                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch_steps = _run(torch_backend, model_path, batches[1:], load=from_megatron,
                       save=from_torch)
    _assert_same_step(torch_steps[0], megatron_steps[1])
    (resumed,) = _run(megatron.model_copy(update={"tp_size": 1}), model_path, batches[2:],
                      load=from_torch)
    _assert_same_step(resumed, torch_steps[1])
