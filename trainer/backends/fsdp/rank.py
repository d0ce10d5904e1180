"""The FSDP2 machinery every role's rank shares: the process group and device mesh, the
model sharded over the whole world (gradients summed over DP×CP by FSDP's
reduce-scatter), the optimizer and schedule, full weights in and out, sharded
checkpoints. A role adds its head (its model's output and loss):

    FSDPRank ─┬─ FSDPWorker            the policy      (backends/fsdp/worker.py)
              ├─ FSDPCriticWorker      the value       (backends/fsdp/critic.py)
              └─ FSDPRewardModelWorker the score       (backends/fsdp/reward_model.py)

Rank layout: rank = dp_rank · cp_size + cp_rank. Every rank of a DP group sees the same
samples; its CP rank keeps the zigzag shard of each sequence (``trainer/micro_batch.py``).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from trainer import lora
from trainer.backends.fsdp import model as fsdp
from trainer.checkpoint import (
    ADAPTER_DIR,
    is_sharded,
    load_sharded,
    load_trainer_checkpoint,
    restore_schedule_and_rng,
    save_sharded,
    trainer_state,
)
from trainer.micro_batch import MicroBatch
from trainer.optim import build_optimizer, build_scheduler
from trainer.rank import compute_dtype
from trainer.worker import TrainerRank


class FSDPRank(TrainerRank):
    """The FSDP2 backend's verbs of every rank (``TrainerRank``); the role builds its
    model (``_build``)."""

    def setup(self, master_addr: str, master_port: int) -> None:
        config = self.config
        self.device = self._join_process_group(master_addr, master_port)
        # rank = dp_rank · cp_size + cp_rank: the mesh's row-major layout.
        self.dp_rank, self.cp_rank = divmod(self.rank, config.cp_size)
        self.mesh = init_device_mesh(self.device.type, (config.dp_size, config.cp_size),
                                     mesh_dim_names=("dp", "cp"))
        self.dp_group, self.cp_group = self.mesh["dp"].get_group(), self.mesh["cp"].get_group()
        torch.manual_seed(config.seed)
        self.compute_dtype = compute_dtype(config, self.device)
        self._build_models()
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.trained, config.optimizer)
        self.scheduler = build_scheduler(self.optimizer, config.optimizer, self.total_steps)

    @abc.abstractmethod
    def _build(self) -> torch.nn.Module:
        """The role's model, sharded over the world (``fsdp.shard_model``)."""

    def _build_models(self) -> None:
        """The models of this rank, after the seed is set: the role's own (the policy
        adds its KL reference)."""
        self.model = self._build()

    def _forward(self, model: torch.nn.Module, micro: MicroBatch, **kwargs: Any) -> Any:
        """``model``'s output on the micro-batch's rows under this rank's attention: the
        row layout's mask and the CP ring, or the model's own (padded rows) and varlen
        flash, which finds the samples from position_ids."""
        kwargs |= {"input_ids": micro.input_ids, "position_ids": micro.position_ids}
        if self.attention.implementation in ("flash_attention_2", "model"):
            return model(**kwargs)
        from trainer.cp_attention import context_parallel

        with context_parallel(self.cp_group, micro.position_ids, micro.layout):
            return model(**kwargs)

    def optimizer_step(self) -> dict[str, float]:
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = self._clip_and_step(self.config.optimizer.grad_clip)
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}

    def _clip_and_step(self, clip: float | None) -> float:
        """Clip the gradients to ``clip`` (None: not at all), step, zero them; the
        global grad norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.trained, clip if clip is not None else float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def _summed_gradients(self) -> dict[str, torch.Tensor] | None:
        """Collective: on rank 0, every trained parameter's gradient, whole and summed over
        DP × CP (float64, by Hugging Face name); None elsewhere. The gradients are zeroed
        after: no optimizer step sees them."""
        grads = {}
        for name, p in self.model.named_parameters():
            if not p.requires_grad:  # LoRA's frozen base
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[name] = full.detach().cpu().double()
        self.optimizer.zero_grad(set_to_none=True)
        return grads if self.rank == 0 else None

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective; rank 0 returns the full Hugging Face state dict, others None."""
        state = fsdp.export_full_state_dict(self.model)
        return state if self.rank == 0 else None

    def load_weights(self, state_dict: dict[str, torch.Tensor] | None) -> None:
        """Collective; rank 0 passes the full state dict, the others None."""
        fsdp.load_full_state_dict(self.model, state_dict or {})

    def save_checkpoint(self, path: str) -> None:
        """Collective; each rank writes its shards of the trained weights (all, or the
        adapters) and their AdamW state, rank 0 the schedule, RNG and model config
        (trainer/checkpoint.py) and, under LoRA, peft's adapter folder."""
        trainable_only = self.config.lora is not None
        save_sharded(path, fsdp.sharded_state(self.model, self.optimizer, trainable_only),
                     trainer_state(None, self.scheduler), self.model_path,
                     self.model.config)
        if trainable_only:  # small: gathered one at a time, kept on rank 0's CPU only
            factors = {}
            for module, (a, b, _) in lora.adapter_params(self.model).items():
                whole_a, whole_b = fsdp.unsharded(a), fsdp.unsharded(b)  # every rank
                if self.rank == 0:
                    factors[module] = (whole_a.cpu(), whole_b.cpu())
            if self.rank == 0:
                lora.save_adapter_folder(Path(path) / ADAPTER_DIR, factors, self.config.lora,
                                         self.model_path)
            dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Collective; each rank reads the shards it owns under this layout (DCP
        reshards a checkpoint written at another DP or CP size)."""
        if not is_sharded(path):  # the Megatron backend's (gathered) format, from rank 0
            model_state, saved = load_trainer_checkpoint(path) if self.rank == 0 else ({}, {})
            fsdp.load_full_state_dict(self.model, model_state)
            fsdp.load_full_optimizer_state(self.model, self.optimizer,
                                           saved.get("optimizer", {}))
        else:
            trainable_only = self.config.lora is not None
            state = fsdp.sharded_state(self.model, self.optimizer, trainable_only)
            saved = load_sharded(path, state)
            fsdp.set_sharded_state(self.model, self.optimizer, state, trainable_only)
        restore_schedule_and_rng(saved, self.scheduler)
