"""One Megatron trainer rank (a Ray actor) with the verbs and metrics of ``TrainerWorker``.

Rank layout (Megatron's order tp-cp-dp): rank = (dp_rank · cp + cp_rank) · tp + tp_rank.
TP ranks of one DP×CP rank see the same tokens; DP ranks take ``plan.micro_batches
[dp_rank]`` and CP ranks the zigzag shard of each sequence (``slice_micro_batch``).

One step: micro-batches run through Megatron's ``get_forward_backward_func`` schedule (on
CPU inside ``cpu_bridge``), the loss function in Megatron's contract (``loss.loss_func``)
scaled by ``loss.megatron_sum_factor``, then :func:`average_gradients` over DP×CP, the
global grad norm over TP shards, and a torch optimizer step from ``trainer/optim.py``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from rollout.batch import TrainBatch
from trainer.backends.megatron import checkpoint as megatron_checkpoint
from trainer.backends.megatron.cpu_bridge import cpu_bridge, install_rng_tracker
from trainer.backends.megatron.loss import (
    REPORTED,
    loss_func,
    megatron_sum_factor,
    vocab_parallel_log_probs,
)
from trainer.backends.megatron.model import build_gpt_model, model_shape
from trainer.backends.megatron.weights import WeightMover
from trainer.config import TrainerConfig
from trainer.optim import build_optimizer, build_scheduler
from trainer.rank import init_rank
from trainer.step_plan import MODE_METRIC_PREFIX, StepPlan
from trainer.worker import MicroBatch, slice_micro_batch


def average_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    """Megatron DDP's reduction: every gradient becomes its MEAN over the DP×CP ranks
    (one flat all-reduce). ``loss.megatron_sum_factor`` turns that mean back into a SUM."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= size
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)


class MegatronWorker:
    """Verbs: setup, train_step, export_weights, load_weights, save_checkpoint,
    load_checkpoint (the same as ``trainer.worker.TrainerWorker``)."""

    def __init__(self, config: TrainerConfig, model_path: str, rank: int, total_steps: int,
                 max_response_len: int | None = None) -> None:
        self.config, self.model_path, self.rank = config, model_path, rank
        self.total_steps, self.max_response_len = total_steps, max_response_len

    def node_address(self) -> tuple[str, int]:
        import ray

        from trainer.group import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        config = self.config
        self.device = init_rank(config, self.rank, master_addr, master_port)
        cuda = self.device.type == "cuda"
        ps.initialize_model_parallel(tensor_model_parallel_size=config.tp_size,
                                     context_parallel_size=config.cp_size,
                                     create_gloo_process_groups=False)
        self.dp_rank, self.cp_rank = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.tp_group = ps.get_tensor_model_parallel_group()
        torch.manual_seed(config.seed)
        install_rng_tracker(config.seed, self.device)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.shape = model_shape(self.hf_config, config.tp_size)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            config.dtype, torch.bfloat16 if cuda else torch.float32)
        self.model, self.weights = self._build(dtype)
        self.ref_model = None
        if config.loss.kl_coef > 0:
            self.ref_model, _ = self._build(dtype)
            self.ref_model.requires_grad_(False)
        self.params = list(self.model.parameters())
        self.optimizer = build_optimizer(self.params, config.optimizer)
        self.scheduler = build_scheduler(self.optimizer, config.optimizer, self.total_steps)

    def _build(self, dtype: torch.dtype) -> tuple[torch.nn.Module, WeightMover]:
        with cpu_bridge(self.device):
            model = build_gpt_model(self.hf_config, self.shape, self.config.cp_size, dtype,
                                    self.device)
        weights = WeightMover(model, self.shape, self.device)
        weights.read_checkpoint(self.model_path)
        return model, weights

    def _forward_step(self, scale: int, mode_names: list[str],
                      data_iterator: Iterator[MicroBatch], model: torch.nn.Module
                      ) -> tuple[torch.Tensor, functools.partial]:
        """Megatron's forward_step_func: (vocab-parallel logits, the loss function)."""
        micro = next(data_iterator)
        ref_log_probs = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logits = self.ref_model(micro.input_ids, micro.position_ids, None)
                ref_log_probs, _ = vocab_parallel_log_probs(ref_logits, micro.targets,
                                                            self.shape)
        logits = model(micro.input_ids, micro.position_ids, None)
        return logits, functools.partial(loss_func, micro, ref_log_probs, self.config.loss,
                                         self.shape, scale, mode_names)

    def train_step(self, batch: TrainBatch, plan: StepPlan) -> dict[str, float]:
        started = time.perf_counter()
        sums = self.forward_backward(batch, plan)
        sums.update(self.optimizer_step())
        sums["padding_fraction"] = plan.padding_fraction
        sums["perf/compute_s"] = time.perf_counter() - started
        return sums

    def forward_backward(self, batch: TrainBatch, plan: StepPlan) -> dict[str, float]:
        """Σ w·ℓ over this rank's tokens, backpropagated; returns the step's exact terms."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        samples_per_micro_batch = plan.micro_batches[self.dp_rank]
        num_micro_batches = len(samples_per_micro_batch)  # the same on every DP rank
        scale = megatron_sum_factor(self.config.dp_size, num_micro_batches)
        mode_names = [k for k in plan.weights if k.startswith(MODE_METRIC_PREFIX)]
        micros = [slice_micro_batch(batch, plan, samples, self.config.cp_size,
                                    self.cp_rank).to(self.device)
                  for samples in samples_per_micro_batch]
        self.model.train()
        with cpu_bridge(self.device):
            reported = get_forward_backward_func()(
                forward_step_func=functools.partial(self._forward_step, scale, mode_names),
                data_iterator=iter(micros), model=[self.model],
                num_microbatches=num_micro_batches,
                seq_length=max(m.input_ids.shape[1] for m in micros),
                micro_batch_size=max(m.input_ids.shape[0] for m in micros),
                forward_only=False)
        average_gradients(self.params, self.dp_cp_group)
        totals = torch.stack([r["sums"] for r in reported]).sum(dim=0).cpu()
        dist.all_reduce(totals, group=self.dp_cp_group)  # TP ranks hold identical sums
        names = [*REPORTED, *mode_names]
        values = dict(zip(names, totals.tolist(), strict=True))
        num_valid = max(values["valid_tokens"], 1)
        values["clip_fraction"] = values.pop("clipped_tokens") / num_valid
        values["mismatch/log_prob_abs_diff"] = values.pop("log_prob_abs_diff") / num_valid
        return values

    def _grad_norm(self) -> torch.Tensor:
        """‖∇‖ over the whole model: TP-sharded parameters summed over the TP group,
        TP-replicated ones (norms) counted once."""
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.weights.params.items():
            if p.grad is not None and (self.weights.tp_sharded[name] or self.weights.tp_rank == 0):
                squares += p.grad.double().square().sum()
        if self.config.tp_size > 1:
            dist.all_reduce(squares, group=self.tp_group)
        return squares.sqrt()

    def optimizer_step(self) -> dict[str, float]:
        grad_norm = float(self._grad_norm())
        clip = self.config.optimizer.grad_clip
        if clip is not None:  # as torch.nn.utils.clip_grad_norm_
            coefficient = min(1.0, clip / (grad_norm + 1e-6))
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective; rank 0 returns the full Hugging Face state dict, others None."""
        return self.weights.export()

    def load_weights(self, state_dict: dict[str, torch.Tensor] | None) -> None:
        """Collective; rank 0 passes the full HF state dict, the others None."""
        self.weights.load(state_dict if self.rank == 0 else None)

    def save_checkpoint(self, path: str) -> None:
        """Collective; rank 0 writes the model (HF safetensors) and the trainer state."""
        megatron_checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Collective; rank 0 reads, every rank takes its slices."""
        megatron_checkpoint.load(self, path)
