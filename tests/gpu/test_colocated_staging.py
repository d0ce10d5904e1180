"""The colocated engine's staging on one CUDA GPU (services/driver/weight_staging.py), no Ray:

- copied on the side stream, a version served after its event decodes what an in-place
  stage of it decodes, bf16 from fp32 masters, and a one-rank trainer's step queued right
  after a fenced stage does not reach the staged copy;
- the stage returns before its copies finish (the host goes on), and the copy's bandwidth
  into a reused 2 GB set, the figure docs/rollout.md's HBM line is read against.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.tiny import create_tiny_checkpoint
from services.driver.colocated_engine import ColocatedEngine, StageMode
from services.driver.weight_staging import BufferSets, StreamCopy
from tests.gpu.needs import DEVICE, needs

pytestmark = pytest.mark.gpu
PROMPTS = [[1, 70, 84, 4, 69, 70, 33], [1, 86, 73, 90, 4, 69, 33], [1, 69, 33]] * 3
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=10)


def _engine(path: str, mode: StageMode) -> ColocatedEngine:
    return ColocatedEngine(TorchEngineConfig(batch_size=4, dtype="bfloat16", device=DEVICE),
                           path, None, 0, torch.device(DEVICE), mode)


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    owned = dict(model.named_parameters()) | dict(model.named_buffers())
    return [(name, tensor.detach()) for name, tensor in owned.items()]


@needs(1)
def test_side_stream_copy_serves_what_in_place_does(tmp_path, report) -> None:
    path = create_tiny_checkpoint(tmp_path / "tiny", seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(path).to(DEVICE)
    copied, in_place = _engine(path, "copy"), _engine(path, "in_place")
    for engine in (copied, in_place):
        engine.check_names([name for name, _ in _tensors(trainer)])
    for version in (0, 1, 2):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        want = {name: t.to(copied.tensors[name].dtype) for name, t in _tensors(trainer)}
        for engine in (copied, in_place):
            engine.stage(version, _tensors(trainer))
            engine.fence()
        with torch.no_grad():  # the next optimizer step, queued at once on the main stream
            for p in trainer.parameters():
                p.mul_(0.0)
        for engine in (copied, in_place):
            engine.serve(version)
            assert all(torch.equal(engine.tensors[n], t) for n, t in want.items()), version
        assert copied.generate(PROMPTS, SAMPLING, 3) == in_place.generate(PROMPTS, SAMPLING, 3)
        with torch.no_grad():
            for name, p in _tensors(trainer):
                p.copy_(want[name])
    assert copied.num_buffer_sets == 2 and in_place.num_buffer_sets == 1
    report("colocated bf16: copy (side stream) = in place, 3 versions", "equal", "equal")


@needs(1)
def test_stage_returns_before_its_copies_finish(report) -> None:
    if DEVICE != "cuda":
        pytest.skip("no stream off CUDA: the copies are done when stage returns")
    device = torch.device("cuda")
    sources = {f"w{i}": torch.randn(8192, 8192, device=device) for i in range(16)}  # 4 GB
    sets = BufferSets({n: torch.empty(t.shape, dtype=torch.bfloat16, device=device)
                       for n, t in sources.items()})
    copier = StreamCopy(device)
    for _ in range(2):  # the second round: the set reused, nothing allocated
        target = sets.take()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for name, src in sources.items():
            copier.copy(target[name], src)
        queued = time.perf_counter() - started
        done = copier.done()
        assert done is not None
        done.synchronize()
        total = time.perf_counter() - started
        sets.give_back(target)
    moved = sum(t.numel() * (4 + 2) for t in sources.values())  # fp32 read, bf16 write
    assert sets.num_allocated == 0 and queued < total
    report("side-stream stage, 4 GB fp32 → bf16: host time / copy time",
           f"{queued * 1e3:.1f} / {total * 1e3:.1f} ms", "host < copy")
    report("  copy bandwidth, read + write (TB/s)", f"{moved / total / 1e12:.2f}", "")
