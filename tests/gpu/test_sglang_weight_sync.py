"""Weight sync into a real SGLang server over a weight-update process group.

The test process plays the trainer's rank 0 (trainer/transports/nccl.py, from a thread)
while SGLangEngine drives the server's HTTP side: the group is made, weights go over in
2+ buckets, flattened and not, and afterwards the server's log-probs are those of the new
weights under the version it was sent. A failed bucket leaves the engine refusing to
generate until a full version loads (here through the disk path, load_weight_buckets).

NCCL refuses two ranks of one group on one GPU, so with one GPU the group runs on gloo
(SGLang's receive path and HTTP protocol are the same; gloo moves the CUDA tensors through
the host); with two, on NCCL with the server on the second GPU.

One check needs no SGLang: trainer rank 0 against a receiver built the way SGLang builds
its end (sglang.srt.utils.common.init_custom_process_group, FlattenedTensorBucket.empty),
in a child process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist

from rollout.tiny import create_tiny_checkpoint
from rollout.weight_bucket import DTYPES, TensorSpec, pack_bucket, plan_buckets
from tests.gpu.needs import DEVICE, needs
from trainer.transports.nccl import (
    broadcast_bucket,
    destroy_weight_update_group,
    init_weight_update_group,
)

if TYPE_CHECKING:  # imported in the tests: collecting tests/gpu needs no pydantic
    from rollout.engines.sglang_engine import SGLangEngine

pytestmark = pytest.mark.gpu
# The char tokenizer is ours (ids in, ids out); head dim 16 needs SGLang's torch backend.
SGLANG_TINY_ARGS = ["--dtype", "float32", "--skip-tokenizer-init",
                    "--cuda-graph-backend-decode", "disabled",
                    "--cuda-graph-backend-prefill", "disabled",
                    "--attention-backend", "torch_native"]
PROMPTS = [[1, 70, 84], [1, 86, 73, 90], [1, 69], [1, 5, 6, 7], [1, 9]]
GROUP = "tally-weight-sync-test"
TIMEOUT_S = 180.0
NORM_SCALE = 10.0
"""The new weights' final norm, scaled: their log-probs are then far from a random-init
model's near-uniform ones, so that serving the wrong weights cannot pass."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _in_thread(target: Callable[[], object]) -> Callable[[], object]:
    """Run ``target`` in a daemon thread; the returned call joins it and gives its result
    (or raises its exception)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = target()
        except BaseException as error:  # handed to the joining thread
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> object:
        thread.join(TIMEOUT_S)
        if thread.is_alive():
            raise TimeoutError("the trainer's side did not finish")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("result")

    return join


def _named_parameters(path: str, norm_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """What a trainer sends: each parameter once (a tied head is its embedding), fp32,
    the final norm scaled by ``norm_scale``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    state["model.norm.weight"] *= norm_scale
    return state


def _plan(state: dict[str, torch.Tensor], num_buckets: int) -> list[tuple[TensorSpec, ...]]:
    total = sum(t.numel() * 4 for t in state.values())
    buckets = plan_buckets([(n, tuple(t.shape)) for n, t in state.items()], "float32",
                           total // num_buckets + 1)
    assert len(buckets) >= 2
    return buckets


Weights = tuple[str, dict[str, torch.Tensor] | None]
"""A checkpoint's path and what replaces its parameters (None: nothing)."""


def _reference(weights: Weights) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path, state = weights
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)  # each parameter once: the head is tied
        model.tie_weights()
    return model


def _log_probs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def _send(engine: SGLangEngine, group: dist.ProcessGroup, buckets: list[tuple[TensorSpec, ...]],
          state: dict[str, torch.Tensor], version: int, flattened: bool) -> None:
    """Trainer rank 0 broadcasts every bucket from a thread while the engine posts them."""

    def trainer() -> None:
        for specs in buckets:
            if flattened:
                data = pack_bucket(specs, state).data
                tensors = [torch.from_numpy(data).to("cuda")]
            else:
                tensors = [state[s.name].to("cuda", DTYPES[s.dtype]) for s in specs]
            broadcast_bucket(group, tensors, flattened)

    join = _in_thread(trainer)
    engine.update_weights_from_distributed(
        buckets, version, GROUP, flattened)
    join()


def _check_serves(engine: SGLangEngine, new: Weights, old: Weights,
                  report: Callable[[str, str, str], None], what: str) -> None:
    """The engine's samples score as the ``new`` weights say (a teacher-forced pass of
    the HF model), far from what the ``old`` ones say."""
    from rollout.config import SamplingConfig

    generations = engine.generate(
        PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=8), seed=0)
    new_model, old_model = _reference(new), _reference(old)
    worst, apart = 0.0, 0.0
    for prompt, gen in zip(PROMPTS, generations, strict=True):
        served = torch.tensor(gen.log_probs)
        worst = max(worst, float((served - _log_probs(new_model, prompt, gen.token_ids))
                                 .abs().max()))
        apart = max(apart, float((served - _log_probs(old_model, prompt, gen.token_ids))
                                 .abs().mean()))
    report(f"{what}: max |log-prob - new weights'|", f"{worst:.2e}", "< 1e-3")
    report(f"{what}: mean |log-prob - old weights'|", f"{apart:.2e}", "> 0.05")
    assert worst < 1e-3
    assert apart > 0.05


@pytest.fixture
def checkpoints(tmp_path: Path) -> tuple[str, str]:
    return (create_tiny_checkpoint(tmp_path / "seed0", seed=0),
            create_tiny_checkpoint(tmp_path / "seed1", seed=1))


@pytest.fixture
def gloo_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gloo on 127.0.0.1 for both ends (the server inherits the environment)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture
def engine_factory(checkpoints: tuple[str, str]) -> Iterator[Callable[[int], SGLangEngine]]:
    from rollout.config import SGLangEngineConfig
    from rollout.engines.sglang_engine import SGLangEngine

    engines: list[SGLangEngine] = []

    def make(port: int) -> SGLangEngine:
        config = SGLangEngineConfig(base_port=port, mem_fraction_static=0.3,
                                    extra_args=SGLANG_TINY_ARGS)
        engines.append(SGLangEngine(config, checkpoints[0]))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


def _join_group(engine: SGLangEngine, backend: str) -> dist.ProcessGroup:
    port = _free_port()
    world_size = 1 + engine.num_weight_ranks()
    join = _in_thread(lambda: init_weight_update_group(
        "127.0.0.1", port, world_size, GROUP, backend=backend, timeout_s=TIMEOUT_S))
    engine.init_weights_update_group("127.0.0.1", port, 1, world_size, GROUP, backend)
    group = join()
    assert isinstance(group, dist.ProcessGroup)
    return group


@needs(1, ("sglang",))
def test_weights_over_a_group_in_buckets_then_a_failed_bucket(
        checkpoints: tuple[str, str], engine_factory: Callable[[int], SGLangEngine],
        gloo_on_loopback: None, report: Callable[[str, str, str], None]) -> None:
    from rollout.config import SamplingConfig
    from rollout.engines.sglang_engine import SGLangError

    seed0, seed1 = checkpoints
    engine = engine_factory(31820)
    group = _join_group(engine, "gloo")
    try:
        new = _named_parameters(seed1, norm_scale=NORM_SCALE)
        _send(engine, group, _plan(new, 3), new, version=1, flattened=False)
        assert engine.served_weight_version() == "1"
        _check_serves(engine, (seed1, new), (seed0, None), report, "per-tensor buckets")

        old = _named_parameters(seed0)
        _send(engine, group, _plan(old, 2), old, version=2, flattened=True)
        assert engine.served_weight_version() == "2"
        _check_serves(engine, (seed0, None), (seed1, new), report, "flattened buckets")

        # Bucket 1 names a shape the model does not have: received, then refused on load.
        norm = old["model.norm.weight"]
        bad = {"model.layers.0.input_layernorm.weight": old[
                   "model.layers.0.input_layernorm.weight"] * 2,
               "model.norm.weight": torch.cat([norm, norm[:1]])}
        buckets = [(TensorSpec("model.layers.0.input_layernorm.weight",
                               tuple(norm.shape), "float32"),),
                   (TensorSpec("model.norm.weight", (norm.numel() + 1,), "float32"),)]
        with pytest.raises(SGLangError, match=r"bucket 1 of 2 failed"):
            _send(engine, group, buckets, bad, version=3, flattened=False)
        assert engine.served_weight_version() == "2"
        with pytest.raises(SGLangError, match="weights partially updated"):
            engine.generate(PROMPTS, SamplingConfig(max_new_tokens=2), seed=0)

        # A full version through the disk path (sharded safetensors) restores it.
        engine.load_weight_buckets(
            [pack_bucket(specs, old) for specs in _plan(old, 3)], version=4)
        assert engine.served_weight_version() == "4"
        _check_serves(engine, (seed0, None), (seed1, new), report, "sharded checkpoint")
    finally:
        destroy_weight_update_group(group)


@needs(2, ("sglang",))
def test_weights_over_nccl_to_a_server_on_another_gpu(
        checkpoints: tuple[str, str], engine_factory: Callable[[int], SGLangEngine],
        monkeypatch: pytest.MonkeyPatch, report: Callable[[str, str, str], None]) -> None:
    seed0, seed1 = checkpoints
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # this process keeps every GPU; the server gets one
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    second = visible.split(",")[1] if visible else "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", second)
    engine = engine_factory(31840)
    group = _join_group(engine, "nccl")
    try:
        new = _named_parameters(seed1, norm_scale=NORM_SCALE)
        _send(engine, group, _plan(new, 3), new, version=1, flattened=True)
        assert engine.served_weight_version() == "1"
        _check_serves(engine, (seed1, new), (seed0, None), report, "nccl, flattened")
        _send(engine, group, _plan(new, 2), new, version=2, flattened=False)
        assert engine.served_weight_version() == "2"
    finally:
        destroy_weight_update_group(group)


# SGLang's receiving end, with torch alone: WeightUpdater.init_weights_update_group ->
# init_custom_process_group (tcp:// rendezvous, PrefixStore(group_name), the helper),
# then receive_weights_from_distributed: flattened, FlattenedTensorBucket.empty's buffer;
# not, one async broadcast per tensor.
RECEIVER = r"""
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend, PrefixStore, _new_process_group_helper, _world, rendezvous)

port, world_size, rank, group_name, backend, device, plan, out = sys.argv[1:]
world_size, rank = int(world_size), int(rank)
timeout = timedelta(seconds=120)
store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, world_size,
                                          timeout=timeout))
store.set_timeout(timeout)
group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                     PrefixStore(group_name, store), group_name=group_name,
                                     timeout=timeout)
_world.pg_group_ranks[group] = {i: i for i in range(world_size)}
received = {}
for bucket in json.loads(plan):
    dtypes = [getattr(torch, d) for d in bucket["dtypes"]]
    if bucket["flattened"]:
        sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(bucket["shapes"], dtypes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=group)
        offset = 0
        for name, shape, dtype, size in zip(bucket["names"], bucket["shapes"], dtypes, sizes):
            received[name] = flat[offset:offset + size].view(dtype).reshape(shape).cpu()
            offset += size
    else:
        tensors = [torch.empty(s, dtype=d, device=device)
                   for s, d in zip(bucket["shapes"], dtypes)]
        works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
        for work in works:
            work.wait()
        received.update({n: t.cpu() for n, t in zip(bucket["names"], tensors)})
torch.save(received, out)
dist.destroy_process_group(group)
"""


@needs(1)
def test_trainer_rank_0_meets_a_receiver_built_like_sglang(
        tmp_path: Path, gloo_on_loopback: None) -> None:
    """Two ranks in one group: on one GPU (or the CPU stand-in) that is gloo."""
    generator = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3, 5, generator=generator),
             "b": torch.randn(7, generator=generator),
             "c": torch.randn(2, 2, 2, generator=generator)}
    buckets = plan_buckets([(n, tuple(t.shape)) for n, t in state.items()], "bfloat16", 32)
    assert len(buckets) >= 2
    flags = [index % 2 == 0 for index in range(len(buckets))]
    plan = [{"names": [s.name for s in specs], "dtypes": [s.dtype for s in specs],
             "shapes": [list(s.shape) for s in specs], "flattened": flat}
            for specs, flat in zip(buckets, flags, strict=True)]
    port, out = _free_port(), tmp_path / "received.pt"
    root = Path(__file__).resolve().parents[2]
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(port), "2", "1", GROUP, "gloo", DEVICE,
         json.dumps(plan), str(out)], cwd=root)
    try:
        group = init_weight_update_group("127.0.0.1", port, 2, GROUP, backend="gloo",
                                         timeout_s=120)
        for specs, flat in zip(buckets, flags, strict=True):
            if flat:
                tensors = [torch.from_numpy(pack_bucket(specs, state).data).to(DEVICE)]
            else:
                tensors = [state[s.name].to(DEVICE, DTYPES[s.dtype]) for s in specs]
            broadcast_bucket(group, tensors, flat)
        assert receiver.wait(timeout=120) == 0
        destroy_weight_update_group(group)
    finally:
        if receiver.poll() is None:
            receiver.kill()
    received = torch.load(out)
    assert set(received) == set(state)
    for name, tensor in state.items():
        assert received[name].dtype == torch.bfloat16
        assert torch.equal(received[name], tensor.to(torch.bfloat16)), name
