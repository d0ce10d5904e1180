"""One trainer rank (a Ray actor): a few small verbs the driver calls in lock step.

Rank layout: rank = dp_rank · cp_size + cp_rank. Every rank of a DP group sees the same
samples; its CP rank keeps the zigzag shard of each sequence. Per-token tensors are
shifted to next-token positions *before* sharding, so a shard never needs its
neighbour's token to know its target.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rollout.batch import TrainBatch
from trainer.aggregation import local_weighted_sum, sum_reduction_factor
from trainer.backends import fsdp
from trainer.config import TrainerConfig
from trainer.context_parallel import zigzag_positions, zigzag_shard
from trainer.losses import entropy_from_logits, kl_penalty, policy_gradient_loss, token_log_probs
from trainer.optim import build_optimizer, build_scheduler
from trainer.rank import init_rank, restore_schedule_and_rng, trainer_state
from trainer.step_plan import MODE_METRIC_PREFIX, StepPlan


@dataclass
class MicroBatch:
    """One micro-batch as this rank sees it: [b, S_local] tensors on next-token positions."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_log_probs: torch.Tensor
    weights: dict[str, torch.Tensor]

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(**{
            name: ({k: v.to(device) for k, v in value.items()} if isinstance(value, dict)
                   else value.to(device))
            for name, value in vars(self).items()
        })


def _shift_left(x: torch.Tensor) -> torch.Tensor:
    """Value at position t becomes the target of position t−1 (last position gets 0)."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def slice_micro_batch(
    batch: TrainBatch, plan: StepPlan, samples: list[int], cp_size: int, cp_rank: int
) -> MicroBatch:
    if not samples:  # an empty micro-batch keeps FSDP's collectives in step; weight 0
        samples, empty = [0], True
    else:
        empty = False
    index = torch.tensor(samples)
    width = int(batch.sequence_lengths[index].max())
    input_ids = batch.input_ids[index, :width]
    weights = {k: _shift_left(w[index, :width]) for k, w in plan.weights.items()}
    loss_mask = _shift_left(batch.loss_mask[index, :width])
    if empty:
        weights = {k: torch.zeros_like(w) for k, w in weights.items()}
        loss_mask = torch.zeros_like(loss_mask)

    def shard(x: torch.Tensor) -> torch.Tensor:
        return zigzag_shard(x, cp_size, cp_rank, dim=1)

    positions = zigzag_positions(width, cp_size, cp_rank)[None, :].expand(len(samples), -1)
    return MicroBatch(
        input_ids=shard(input_ids),
        position_ids=positions.contiguous(),
        targets=shard(_shift_left(input_ids)),
        loss_mask=shard(loss_mask),
        advantages=batch.advantages[index, None].expand(-1, positions.shape[1]).contiguous(),
        rollout_log_probs=shard(_shift_left(batch.rollout_log_probs[index, :width])),
        weights={k: shard(w) for k, w in weights.items()},
    )


class TrainerWorker:
    """Verbs: setup, train_step (forward_backward + optimizer_step), export_weights,
    load_weights, save_checkpoint, load_checkpoint. The group stops a rank by killing its
    actor (a rank stuck in a collective could not answer a polite call)."""

    def __init__(self, config: TrainerConfig, model_path: str, rank: int, total_steps: int,
                 max_response_len: int | None = None) -> None:
        self.config, self.model_path, self.rank = config, model_path, rank
        self.total_steps, self.max_response_len = total_steps, max_response_len
        self.cp_rank, self.dp_rank = rank % config.cp_size, rank // config.cp_size

    def node_address(self) -> tuple[str, int]:
        """Address and a free port on this actor's node, for the rendezvous of rank 0."""
        import ray

        from trainer.group import free_port

        return ray.util.get_node_ip_address(), free_port()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def setup(self, master_addr: str, master_port: int) -> None:
        config = self.config
        self.device = init_rank(config, self.rank, master_addr, master_port)
        cuda = self.device.type == "cuda"
        # rank = dp_rank · cp_size + cp_rank: the mesh's row-major layout.
        self.mesh = init_device_mesh(self.device.type, (config.dp_size, config.cp_size),
                                     mesh_dim_names=("dp", "cp"))
        self.dp_group, self.cp_group = self.mesh["dp"].get_group(), self.mesh["cp"].get_group()
        torch.manual_seed(config.seed)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            config.dtype, torch.bfloat16 if cuda else torch.float32)
        self.model = self._build(dtype)
        self.ref_model = self._build(dtype) if config.loss.kl_coef > 0 else None
        if self.ref_model is not None:
            self.ref_model.requires_grad_(False)
        self.optimizer = build_optimizer(list(self.model.parameters()), config.optimizer)
        self.scheduler = build_scheduler(self.optimizer, config.optimizer, self.total_steps)

    def _build(self, dtype: torch.dtype) -> torch.nn.Module:
        model = fsdp.load_model(self.model_path, dtype, self.device)
        if self.config.cp_size > 1:
            from trainer.cp_attention import enable_context_parallel

            enable_context_parallel(model)
        return fsdp.shard_model(model)

    def _logits(self, model: torch.nn.Module, micro: MicroBatch) -> torch.Tensor:
        kwargs = {"input_ids": micro.input_ids.to(self.device),
                  "position_ids": micro.position_ids.to(self.device)}
        if self.config.cp_size == 1:
            return model(**kwargs).logits
        from trainer.cp_attention import context_parallel

        with context_parallel(self.cp_group, kwargs["position_ids"]):
            return model(**kwargs).logits

    def train_step(self, batch: TrainBatch, plan: StepPlan) -> dict[str, float]:
        started = time.perf_counter()
        sums = self.forward_backward(batch, plan)
        sums.update(self.optimizer_step())
        sums["padding_fraction"] = plan.padding_fraction
        sums["perf/compute_s"] = time.perf_counter() - started  # rank-local fwd+bwd+step
        return sums

    def forward_backward(self, batch: TrainBatch, plan: StepPlan) -> dict[str, float]:
        """Σ w·ℓ over this rank's tokens, backpropagated; returns the step's exact terms."""
        loss_cfg = self.config.loss
        scale = sum_reduction_factor(self.config.world_size)  # FSDP averages; we SUM
        mode_names = [k for k in plan.weights if k.startswith(MODE_METRIC_PREFIX)]
        names = ["pg_loss", "kl", "entropy", "clipped_tokens", "valid_tokens",
                 "log_prob_abs_diff", *mode_names]
        totals = torch.zeros(len(names), dtype=torch.float64)
        self.model.train()
        for samples in plan.micro_batches[self.dp_rank]:
            micro = slice_micro_batch(batch, plan, samples, self.config.cp_size, self.cp_rank)
            micro = micro.to(self.device)
            logits = self._logits(self.model, micro)
            log_probs = token_log_probs(logits, micro.targets)
            old = (log_probs.detach() if loss_cfg.old_log_probs == "trainer"
                   else micro.rollout_log_probs)
            terms = policy_gradient_loss(log_probs, old, micro.advantages, loss_cfg,
                                         micro.rollout_log_probs)
            pg = torch.where(micro.loss_mask > 0, terms.pg_loss, 0.0)  # no inf·0 on padding
            pg_sum = local_weighted_sum(pg, micro.weights["pg"])
            objective, kl = pg_sum, torch.zeros((), device=self.device)
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_log_probs = token_log_probs(self._logits(self.ref_model, micro),
                                                    micro.targets)
                per_token_kl = kl_penalty(log_probs, ref_log_probs, loss_cfg.kl_estimator)
                per_token_kl = torch.where(micro.loss_mask > 0, per_token_kl, 0.0)
                kl = local_weighted_sum(per_token_kl, micro.weights["kl"])
                objective = objective + loss_cfg.kl_coef * kl
            with torch.set_grad_enabled(loss_cfg.entropy_coef > 0):
                entropy = local_weighted_sum(entropy_from_logits(logits), micro.weights["entropy"])
            if loss_cfg.entropy_coef > 0:
                objective = objective - loss_cfg.entropy_coef * entropy
            (objective * scale).backward()
            with torch.no_grad():
                totals += torch.stack([
                    pg_sum, kl, entropy, (terms.clipped * micro.loss_mask).sum(),
                    micro.loss_mask.sum(),
                    ((log_probs.detach() - micro.rollout_log_probs).abs() * micro.loss_mask).sum(),
                    *[local_weighted_sum(pg, micro.weights[k]) for k in mode_names],
                ]).detach().double().cpu()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every token is owned by one rank
        values = dict(zip(names, totals.tolist(), strict=True))
        num_valid = max(values["valid_tokens"], 1)
        values["clip_fraction"] = values.pop("clipped_tokens") / num_valid
        # Train-inference mismatch: mean |log π_trainer − log π_rollout| per valid token.
        values["mismatch/log_prob_abs_diff"] = values.pop("log_prob_abs_diff") / num_valid
        return values

    def optimizer_step(self) -> dict[str, float]:
        clip = self.config.optimizer.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip is not None else float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"grad_norm": float(grad_norm), "lr": lr}

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective; rank 0 returns the full Hugging Face state dict, others None."""
        state = fsdp.export_full_state_dict(self.model)
        return state if self.rank == 0 else None

    def load_weights(self, state_dict: dict[str, torch.Tensor] | None) -> None:
        """Collective; rank 0 passes the full state dict, the others None."""
        fsdp.load_full_state_dict(self.model, state_dict or {})

    def save_checkpoint(self, path: str) -> None:
        """Collective; rank 0 writes the model (HF safetensors) and the trainer state."""
        from trainer.checkpoint import save_trainer_checkpoint

        model_state = fsdp.export_full_state_dict(self.model)
        optim_state = fsdp.export_optimizer_state(self.model, self.optimizer)
        if self.rank == 0:
            save_trainer_checkpoint(path, self.model_path, self.model, model_state,
                                    trainer_state(optim_state, self.scheduler))
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Collective; rank 0 reads, FSDP broadcasts to the other ranks."""
        from trainer.checkpoint import load_trainer_checkpoint

        model_state, saved = load_trainer_checkpoint(path) if self.rank == 0 else ({}, {})
        fsdp.load_full_state_dict(self.model, model_state)
        fsdp.load_optimizer_state(self.model, self.optimizer, saved.get("optimizer", {}))
        restore_schedule_and_rng(saved, self.scheduler)
