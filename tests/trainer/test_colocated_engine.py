"""The colocated engine (trainer/colocated_engine.py) in one process, no Ray: it decodes
what an engine loaded from the folder decodes, aliases or copies the trainer's tensors as
told, and serves only whole staged versions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.torch_engine import TorchEngine
from rollout.tiny import create_tiny_checkpoint
from trainer.colocated_engine import ColocatedEngine

PROMPTS = [[1, 70, 84, 4, 69, 70, 33], [1, 86, 73, 90, 4, 69, 33], [1, 69, 33]] * 3
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=10, stop=["e", "t"])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


def trainer_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a one-rank FSDP trainer yields: each parameter once, every buffer."""
    owned = dict(model.named_parameters()) | dict(model.named_buffers())
    return [(name, tensor.detach()) for name, tensor in owned.items()]


def start(tiny_path: str, trainer: torch.nn.Module, alias: bool) -> ColocatedEngine:
    engine = ColocatedEngine(TorchEngineConfig(batch_size=4), tiny_path, None, 0,
                             torch.device("cpu"), alias)
    engine.check_names([name for name, _ in trainer_tensors(trainer)])
    engine.stage(0, trainer_tensors(trainer))
    engine.serve(0)
    return engine


@pytest.mark.parametrize("alias", [True, False])
def test_decodes_what_an_engine_loaded_from_the_folder_decodes(tiny_path: str,
                                                               alias: bool) -> None:
    trainer = AutoModelForCausalLM.from_pretrained(tiny_path)
    colocated = start(tiny_path, trainer, alias)
    loaded = TorchEngine(TorchEngineConfig(batch_size=4), tiny_path)
    for sampling in (SAMPLING, SAMPLING.model_copy(update={"temperature": 0.0})):
        assert colocated.generate(PROMPTS, sampling, 5) == loaded.generate(PROMPTS, sampling, 5)


def test_aliased_weights_are_the_trainers_and_copied_ones_a_whole_version(
        tiny_path: str, tmp_path: Path) -> None:
    trainer = AutoModelForCausalLM.from_pretrained(tiny_path)
    aliased, copied = start(tiny_path, trainer, True), start(tiny_path, trainer, False)
    before = copied.generate(PROMPTS, SAMPLING, 7)
    assert aliased.stage(1, trainer_tensors(trainer)) == 0  # nothing copied, ever
    with torch.no_grad():  # an optimizer step, in place
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    # The copy serves version 0 until it is told otherwise; the alias is the trainer.
    assert copied.generate(PROMPTS, SAMPLING, 7) == before
    stepped = create_tiny_checkpoint(tmp_path / "stepped", seed=0)
    trainer.save_pretrained(stepped)
    want = TorchEngine(TorchEngineConfig(batch_size=4), stepped).generate(PROMPTS, SAMPLING, 7)
    assert want != before
    assert aliased.generate(PROMPTS, SAMPLING, 7) == want
    num_bytes = copied.stage(1, trainer_tensors(trainer))
    assert num_bytes == sum(t.numel() * t.element_size() for _, t in trainer_tensors(trainer))
    with torch.no_grad():  # a later step does not reach a staged version
        for p in trainer.parameters():
            p.mul_(0.0)
    copied.serve(1)
    assert copied.generate(PROMPTS, SAMPLING, 7) == want
    with pytest.raises(KeyError, match="weights 2 were never staged"):
        copied.serve(2)


def test_the_trainer_must_hold_every_tensor_the_model_needs(tiny_path: str) -> None:
    trainer = AutoModelForCausalLM.from_pretrained(tiny_path)
    engine = ColocatedEngine(TorchEngineConfig(), tiny_path, None, 0, torch.device("cpu"),
                             alias=False)
    names = [name for name, _ in trainer_tensors(trainer)]
    with pytest.raises(ValueError, match="missing"):
        engine.check_names(names[1:])
    engine.check_names(names)
