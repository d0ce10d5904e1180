"""The colocated engine (services/driver/colocated_engine.py) in one process, no Ray: it decodes
what an engine loaded from the folder decodes, aliases, copies or stages in place the
trainer's tensors as told, serves only whole staged versions, reuses its buffer sets and
keeps (or, in place, refuses to serve) its weights after a failed stage."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.torch_engine import TorchEngine
from rollout.tiny import create_tiny_checkpoint
from services.driver.colocated_engine import ColocatedEngine, StageMode

PROMPTS = [[1, 70, 84, 4, 69, 70, 33], [1, 86, 73, 90, 4, 69, 33], [1, 69, 33]] * 3
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=10, stop=["e", "t"])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


def trainer_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a one-rank FSDP trainer yields: each parameter once, every buffer."""
    owned = dict(model.named_parameters()) | dict(model.named_buffers())
    return [(name, tensor.detach()) for name, tensor in owned.items()]


def start(tiny_path: str, trainer: torch.nn.Module, mode: StageMode,
          dtype: str = "float32") -> ColocatedEngine:
    engine = ColocatedEngine(TorchEngineConfig(batch_size=4, dtype=dtype), tiny_path, None,
                             0, torch.device("cpu"), mode)
    engine.check_names([name for name, _ in trainer_tensors(trainer)])
    engine.stage(0, trainer_tensors(trainer))
    engine.serve(0)
    return engine


@pytest.mark.parametrize("mode", ["alias", "copy"])
def test_decodes_what_an_engine_loaded_from_the_folder_decodes(tiny_path: str,
                                                               mode: StageMode) -> None:
    trainer = AutoModelForCausalLM.from_pretrained(tiny_path)
    colocated = start(tiny_path, trainer, mode)
    loaded = TorchEngine(TorchEngineConfig(batch_size=4), tiny_path)
    for sampling in (SAMPLING, SAMPLING.model_copy(update={"temperature": 0.0})):
        assert colocated.generate(PROMPTS, sampling, 5) == loaded.generate(PROMPTS, sampling, 5)


def test_aliased_weights_are_the_trainers_and_copied_ones_a_whole_version(
        tiny_path: str, tmp_path: Path) -> None:
    trainer = AutoModelForCausalLM.from_pretrained(tiny_path)
    aliased, copied = start(tiny_path, trainer, "alias"), start(tiny_path, trainer, "copy")
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
                             mode="copy")
    names = [name for name, _ in trainer_tensors(trainer)]
    with pytest.raises(ValueError, match="missing"):
        engine.check_names(names[1:])
    engine.check_names(names)


def step(trainer: torch.nn.Module, seed: int) -> None:
    """An optimizer step's worth of change, in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3)


def served(engine: ColocatedEngine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.tensors.items()}


def pointers(engine: ColocatedEngine) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in engine.tensors.values())


def gather_failing_after(tensors: list[tuple[str, torch.Tensor]], num_ok: int
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """A trainer's stream whose gather fails after ``num_ok`` tensors."""
    yield from tensors[:num_ok]
    raise RuntimeError("all-gather failed")


def test_copy_mode_reuses_its_buffer_sets_across_versions(tiny_path: str) -> None:
    """The model's own tensors and one spare serve every version; a third set exists
    only while two versions wait, and never a fresh set per version."""
    trainer = AutoModelForCausalLM.from_pretrained(tiny_path)
    engine = start(tiny_path, trainer, "copy")
    seen = {pointers(engine)}
    for version in range(1, 5):
        step(trainer, version)
        engine.stage(version, trainer_tensors(trainer))
        engine.serve(version)
        seen.add(pointers(engine))
        assert engine.num_buffer_sets == 2
    assert len(seen) == 2 and engine.buffers is not None and engine.buffers.num_allocated == 1
    for version in (5, 6):  # two versions wait (the trainer ahead of the manager's queue)
        step(trainer, version)
        engine.stage(version, trainer_tensors(trainer))
    assert engine.num_buffer_sets == 3 and engine.buffers.num_allocated == 2
    engine.serve(6)  # 5 is dropped: its set and the one served before are spare now
    assert engine.num_buffer_sets == 2
    assert all(torch.equal(engine.tensors[name], t) for name, t in trainer_tensors(trainer))
    seen.add(pointers(engine))
    for version in (7, 8):
        step(trainer, version)
        engine.stage(version, trainer_tensors(trainer))
        engine.serve(version)
        assert pointers(engine) in seen and engine.num_buffer_sets == 2
    assert engine.buffers.num_allocated == 2


@pytest.mark.parametrize("mode", ["alias", "copy", "in_place"])
def test_a_version_flips_only_when_every_tensor_is_in(tiny_path: str, mode: StageMode
                                                      ) -> None:
    """A stream that lacks a tensor, repeats one or gives one another shape stages
    nothing; the stream is read to its end first (the other ranks finish the gathers)."""
    trainer = AutoModelForCausalLM.from_pretrained(tiny_path)
    engine = start(tiny_path, trainer, mode)
    tensors = trainer_tensors(trainer)
    name, first = tensors[0]
    bad_streams = {"never came": tensors[1:], "sent twice": [tensors[0], *tensors],
                   "has shape": [(name, first[:1]), *tensors[1:]]}
    for problem, stream in bad_streams.items():
        read = []
        with pytest.raises(ValueError, match=f"weights 1 not staged: .*{problem}"):
            engine.stage(1, (read.append(n) or (n, t) for n, t in stream))
        assert len(read) == len(stream)
        with pytest.raises(KeyError, match="weights 1 were never staged"):
            engine.serve(1)
        assert engine.weight_version == 0
    if mode != "in_place":  # in place, the copies before the problem are in: see below
        assert engine.generate(PROMPTS, SAMPLING, 3) == start(
            tiny_path, trainer, "copy").generate(PROMPTS, SAMPLING, 3)


def test_a_failed_copy_stage_keeps_the_served_weights_bit_for_bit(tiny_path: str) -> None:
    trainer = AutoModelForCausalLM.from_pretrained(tiny_path)
    engine = start(tiny_path, trainer, "copy")
    before, where, tokens = served(engine), pointers(engine), engine.generate(PROMPTS,
                                                                              SAMPLING, 4)
    step(trainer, 1)
    tensors = trainer_tensors(trainer)
    with pytest.raises(RuntimeError, match="all-gather failed"):
        engine.stage(1, gather_failing_after(tensors, len(tensors) // 2))
    assert pointers(engine) == where
    assert all(torch.equal(t, before[name]) for name, t in served(engine).items())
    assert engine.generate(PROMPTS, SAMPLING, 4) == tokens
    engine.stage(1, tensors)  # into the set the failed stage gave back
    assert engine.buffers is not None and engine.buffers.num_allocated == 1
    engine.serve(1)
    assert all(torch.equal(engine.tensors[name], t) for name, t in tensors)


def test_in_place_staging_generates_what_copy_staging_does(tiny_path: str) -> None:
    """In place (bf16 from fp32 masters, as a synchronous multi-rank job serves): one
    set, the served tensors' own storage, and the tokens and log-probs of a copy."""
    trainer = AutoModelForCausalLM.from_pretrained(tiny_path)
    in_place = start(tiny_path, trainer, "in_place", "bfloat16")
    copied = start(tiny_path, trainer, "copy", "bfloat16")
    where = pointers(in_place)
    for version in (1, 2):
        step(trainer, version)
        assert (in_place.stage(version, trainer_tensors(trainer))
                == copied.stage(version, trainer_tensors(trainer)))
        with pytest.raises(RuntimeError, match=f"weights \\[{version}\\] are staged in "
                                               f"place but not served"):
            in_place.generate(PROMPTS, SAMPLING, 1)
        in_place.serve(version)
        copied.serve(version)
        for sampling in (SAMPLING, SAMPLING.model_copy(update={"temperature": 0.0})):
            assert (in_place.generate(PROMPTS, sampling, version)
                    == copied.generate(PROMPTS, sampling, version))
    assert pointers(in_place) == where and in_place.num_buffer_sets == 1
    assert copied.num_buffer_sets == 2


def test_a_failed_in_place_stage_refuses_to_generate_until_a_whole_one(tiny_path: str
                                                                       ) -> None:
    trainer = AutoModelForCausalLM.from_pretrained(tiny_path)
    in_place, copied = start(tiny_path, trainer, "in_place"), start(tiny_path, trainer,
                                                                    "copy")
    step(trainer, 1)
    tensors = trainer_tensors(trainer)
    with pytest.raises(RuntimeError, match="all-gather failed"):
        in_place.stage(1, gather_failing_after(tensors, len(tensors) // 2))
    with pytest.raises(RuntimeError, match="staging weights 1 in place failed part way"):
        in_place.generate(PROMPTS, SAMPLING, 2)
    with pytest.raises(KeyError, match="weights 1 were never staged"):
        in_place.serve(1)
    with pytest.raises(ValueError, match="never came"):  # still torn: not whole either
        in_place.stage(2, tensors[1:])
    with pytest.raises(RuntimeError, match="staging weights 2 in place failed part way"):
        in_place.generate(PROMPTS, SAMPLING, 2)
    step(trainer, 3)
    for engine in (in_place, copied):
        engine.stage(3, trainer_tensors(trainer))
        engine.serve(3)
    assert in_place.generate(PROMPTS, SAMPLING, 2) == copied.generate(PROMPTS, SAMPLING, 2)
