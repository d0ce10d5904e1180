r"""fp32 main parameters, the DP×CP gradient reduction and clipping of the Megatron backend.

The model computes in ``trainer.dtype`` (bf16 on GPU under auto); its parameters are
that dtype too, because megatron-core builds its layers in ``params_dtype``. Updates of
lr 1e-6 on weights near 0.02 are far below bf16's spacing (≈1e-4 there), so an optimizer
stepping the model's own bf16 parameters would leave them unchanged. As in megatron-core's
``Float16OptimizerWithFloat16Params``:

    main      fp32 copies of the model parameters; they own the AdamW state, are what
              checkpoints and ``export_weights`` carry, and are loaded from the checkpoint
    backward  each compute-dtype gradient is added into ``main.grad`` in fp32 as soon as
              autograd has accumulated it (a post-accumulate hook), so micro-batches
              accumulate in fp32, and the model's own ``.grad`` is freed
    step      DP×CP mean (:func:`average_gradients`), grad norm and clipping on the fp32
              main grads, optimizer step, then the main params are copied (rounded) into
              the model

megatron-core's own optimizer does not run on CPU (it creates its scale tensors on
``device="cuda"`` and accepts only ``torch.cuda.*Tensor`` parameters), so this explicit
version serves CPU and GPU alike: one code path, the one the CPU tests cover.

When the compute dtype is already the main dtype (fp32, or fp64 for verification) the main
params *are* the model parameters: no copies, no hooks, the same arithmetic as a plain
torch optimizer on the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from trainer.rank import master_dtype


class MainParams:
    """The optimizer's view of a model: named main params with fp32 gradients."""

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        dtype = master_dtype(compute_dtype)  # Megatron's main params
        self.model_params = dict(model.named_parameters())
        self.separate = any(p.dtype != dtype for p in self.model_params.values())
        if not self.separate:
            self.params = self.model_params
            return
        self.params = {name: torch.nn.Parameter(p.detach().to(dtype, copy=True))
                       for name, p in self.model_params.items()}
        for name, p in self.model_params.items():
            p.register_post_accumulate_grad_hook(self._accumulate_into(self.params[name]))

    @staticmethod
    def _accumulate_into(main: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad.to(main.dtype)
            main.grad = grad if main.grad is None else main.grad.add_(grad)
            param.grad = None  # the compute-dtype gradient is not needed any more
        return hook

    def values(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the main params into the model's compute-dtype parameters."""
        if self.separate:
            for name, p in self.model_params.items():
                p.copy_(self.params[name])

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
        for p in self.model_params.values():
            p.grad = None


def average_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    """Megatron DDP's reduction: every gradient becomes its MEAN over the DP×CP ranks
    (one flat all-reduce, in the main dtype). ``loss.megatron_sum_factor`` turns that
    mean back into a SUM."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    for p in params:
        if p.grad is None:  # every rank must send the same flat buffer
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= size
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)


def grad_norm(params: dict[str, torch.nn.Parameter], tp_sharded: dict[str, bool],
              tp_rank: int, tp_group: dist.ProcessGroup, tp_size: int) -> torch.Tensor:
    """‖∇‖ over the whole model: TP-sharded gradients summed over the TP group,
    TP-replicated ones (norms) counted once."""
    device = next(iter(params.values())).device
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for name, p in params.items():
        if p.grad is not None and (tp_sharded[name] or tp_rank == 0):
            squares += p.grad.double().square().sum()
    if tp_size > 1:
        dist.all_reduce(squares, group=tp_group)
    return squares.sqrt()


def clip_gradients(params: list[torch.nn.Parameter], norm: float, clip: float | None) -> None:
    """Scale gradients so their global norm is at most ``clip``, as
    ``torch.nn.utils.clip_grad_norm_`` does (same coefficient, same epsilon)."""
    if clip is None:
        return
    coefficient = min(1.0, clip / (norm + 1e-6))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coefficient)
