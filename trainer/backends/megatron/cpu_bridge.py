"""Run megatron-core on CPU (tests, CI): bridges its CUDA assumptions, nothing else.

megatron-core 0.16 runs a ``GPTModel`` with the local layer spec on CPU tensors and gloo
collectives, except where it asks CUDA directly:

1. scratch tensors are placed on ``torch.cuda.current_device()``: the attention score
   buffer (``GlobalMemoryBuffer.get_tensor``) and RoPE's ``inv_freq``, moved there on the
   first forward. Within the bridge ``torch.cuda.current_device()`` answers ``"cpu"``.
2. factories with a literal ``device="cuda"``: the token counter of the no-pipelining
   schedule and the default causal mask. A torch-function mode rewrites that device to
   the CPU, so Megatron's own ``get_forward_backward_func`` schedule runs unchanged.
3. the RNG tracker's ``add``/``fork`` save and restore CUDA generator states; the CPU
   tracker below forks the CPU generator instead (init and dropout run under it).

Everything here is inert on GPU: :func:`cpu_bridge` returns a null context and
:func:`install_rng_tracker` seeds Megatron's own CUDA tracker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's model_parallel_cuda_manual_seed offset


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an int means cuda:N


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """``device="cuda"`` (or cuda:N, or a bare device index) -> CPU, in any torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _bridged() -> Iterator[None]:
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        with _CudaFactoriesOnCpu():
            yield
    finally:
        torch.cuda.current_device = current_device


def cpu_bridge(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Wrap model construction and every forward/backward; a no-op unless on CPU."""
    return _bridged() if device.type == "cpu" else contextlib.nullcontext()


def _cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Megatron's named RNG streams, kept as CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_ or name in self.states_:
                raise ValueError(f"rng state {name!r} or seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"rng state {name!r} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def install_rng_tracker(seed: int, device: torch.device) -> None:
    """Seed Megatron's model-parallel RNG streams (after ``initialize_model_parallel``)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mpu_random

    if device.type != "cpu":
        mpu_random.model_parallel_cuda_manual_seed(seed)
        return
    tracker = _cpu_tracker_class()()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add(mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    tracker.add(mpu_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    mpu_random._CUDA_RNG_STATE_TRACKER = tracker
    mpu_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
