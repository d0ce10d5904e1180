"""One Megatron policy rank (a Ray actor): the verbs and metrics of ``PolicyRank``.

Rank layout (Megatron's order tp-cp-dp): rank = (dp_rank · cp + cp_rank) · tp + tp_rank.
TP ranks of one DP×CP rank see the same tokens; DP ranks take ``plan.micro_batches
[dp_rank]`` and CP ranks the zigzag shard of each sequence (``slice_for_plan``: packed
THD rows where the driver's attention decision, ``MegatronAttention``, has them, else
padded micro-batches; the rank takes that decision, it does not detect TransformerEngine).

One step: micro-batches run through Megatron's ``get_forward_backward_func`` schedule (on
CPU inside ``cpu_bridge``) in the compute dtype, the loss function in Megatron's contract
(``loss.loss_func``: log-probs of π_T, then ``trainer/objective.py``) scaled by
``loss.megatron_sum_factor``; gradients land in fp32 main params (``main_params.py``), are
averaged over DP×CP, clipped by the global norm over TP shards, and a torch optimizer
from ``trainer/optim.py`` steps the main params, which are then copied into the model.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist

from rollout.batch import RolloutBatch
from trainer.backends.megatron import MegatronAttention, decide_attention
from trainer.backends.megatron import checkpoint as megatron_checkpoint
from trainer.backends.megatron.convert import HF_TIED_HEAD
from trainer.backends.megatron.cpu_bridge import cpu_bridge, install_rng_tracker
from trainer.backends.megatron.loss import loss_func, megatron_sum_factor, vocab_parallel_log_probs
from trainer.backends.megatron.main_params import (
    MainParams,
    average_gradients,
    clip_gradients,
    grad_norm,
)
from trainer.backends.megatron.model import build_gpt_model, model_shape
from trainer.backends.megatron.weights import WeightMover
from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.micro_batch import (
    MicroBatch,
    gather_log_probs,
    slice_micro_batch,
    slice_packed_row,
)
from trainer.objective import step_metrics
from trainer.optim import build_optimizer, build_scheduler
from trainer.policy_rank import PolicyRank
from trainer.rank import compute_dtype
from trainer.step_plan import StepPlan


class MegatronWorker(PolicyRank):
    """The Megatron-core backend's policy verbs (``PolicyRank``); its rank layout (tp-cp-dp)
    comes from Megatron's ``parallel_state``."""

    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 rank: int, total_steps: int, attention: MegatronAttention | None = None
                 ) -> None:
        """``attention``: the driver's decision (``decide_attention``, the one the step
        plan packs by); None decides the same way here, for a caller that passes none."""
        super().__init__(config, objective, model_path, rank, total_steps)
        self.attention = attention if attention is not None else decide_attention(config)

    def setup(self, master_addr: str, master_port: int) -> None:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        config = self.config
        self.device = self._join_process_group(master_addr, master_port)
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
        self.compute_dtype = compute_dtype(config, self.device)
        self.model = self._build()
        self.main = MainParams(self.model, self.compute_dtype)
        self.params = self.main.values()
        self.weights = WeightMover(self.model, self.shape, self.device, self.main.params)
        self.weights.read_checkpoint(self.model_path)  # into the main params, unrounded
        self.main.copy_to_model()
        self.ref_model = self._build_reference() if config.loss.kl_coef > 0 else None
        self._build_optimizer()

    def _build(self) -> torch.nn.Module:
        with cpu_bridge(self.device):
            return build_gpt_model(self.hf_config, self.shape, self.config.cp_size,
                                   self.compute_dtype, self.device,
                                   transformer_engine=self.attention.transformer_engine)

    def _build_reference(self) -> torch.nn.Module:
        """The frozen reference policy: no grads, so no main params; it only computes."""
        model = self._build()
        WeightMover(model, self.shape, self.device).read_checkpoint(self.model_path)
        return model.requires_grad_(False)

    def _slice(self, batch: RolloutBatch, plan: StepPlan, samples: list[int]) -> MicroBatch:
        """A packed row where THD runs (the plan packs and this rank has TE's layer
        spec), else the same samples padded: the local spec has no packed-sequence path."""
        if plan.packed and self.attention.transformer_engine:
            return slice_packed_row(batch, plan, samples, self.config.cp_size, self.cp_rank,
                                    self.planted)
        return slice_micro_batch(batch, plan, samples, self.config.cp_size, self.cp_rank)

    @staticmethod
    def _logits(model: torch.nn.Module, micro: MicroBatch) -> torch.Tensor:
        """Vocab-parallel logits; a packed row goes in as THD (TransformerEngine on GPU):
        one sequence whose samples ``cu_seqlens`` separates, RoPE restarting per sample."""
        if micro.cu_seqlens is None:
            return model(micro.input_ids, micro.position_ids, None)
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = micro.cu_seqlens.to(device=micro.input_ids.device, dtype=torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        return model(micro.input_ids, micro.position_ids, None, packed_seq_params=packed)

    def _forward_step(self, scale: int, mode_names: list[str],
                      data_iterator: Iterator[MicroBatch], model: torch.nn.Module
                      ) -> tuple[torch.Tensor, functools.partial]:
        """Megatron's forward_step_func: (vocab-parallel logits, the loss function)."""
        micro = next(data_iterator)
        ref_log_probs = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logits = self._logits(self.ref_model, micro)
                ref_log_probs, _ = vocab_parallel_log_probs(ref_logits, micro.targets,
                                                            self.shape,
                                                            self.objective.temperature)
        logits = self._logits(model, micro)
        return logits, functools.partial(loss_func, micro, ref_log_probs, self.config.loss,
                                         self.objective, self.shape, scale, mode_names,
                                         self.planted)

    def forward_backward(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Σ w·ℓ over this rank's tokens, backpropagated into the main params' fp32 grads
        and averaged over DP×CP; returns the step's exact terms."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        samples_per_micro_batch = plan.micro_batches[self.dp_rank]
        num_micro_batches = len(samples_per_micro_batch)  # the same on every DP rank
        scale = megatron_sum_factor(self.config.dp_size, num_micro_batches)
        mode_names = plan.mode_metric_names
        micros = [self._slice(batch, plan, samples).to(self.device)
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
        return step_metrics(totals, mode_names)

    def _gathered(self, batch: RolloutBatch, plan: StepPlan, with_entropy: bool
                  ) -> list[torch.Tensor] | None:
        """log π_T (and H(π_T), ``vocab_parallel_log_probs``' reduction over TP) of every
        response token, [N, S] each; rank 0 returns them. TP ranks hold identical values
        after the vocab-parallel reduction, so only TP rank 0 of CP rank 0 of each DP
        group writes."""
        from megatron.core import parallel_state as ps

        outs = [torch.zeros(batch.input_ids.shape, dtype=torch.float32)
                for _ in range(2 if with_entropy else 1)]
        owner = self.cp_rank == 0 and ps.get_tensor_model_parallel_rank() == 0
        for samples in plan.micro_batches[self.dp_rank]:
            micro = self._slice(batch, plan, samples).to(self.device)
            with cpu_bridge(self.device):
                logits = self._logits(self.model, micro)
            log_probs, entropy = vocab_parallel_log_probs(
                logits, micro.targets, self.shape, self.objective.temperature,
                entropy=False if with_entropy else None)  # False: no graph
            for value, out in zip((log_probs, entropy), outs, strict=False):
                gather_log_probs(batch, samples, value, out, ps.get_context_parallel_group(),
                                 self.config.cp_size, owner,
                                 packed=micro.cu_seqlens is not None)
        for out in outs:
            dist.all_reduce(out)  # each sample written by exactly one rank
        return outs if self.rank == 0 else None

    def _gradients(self, batch: RolloutBatch, plan: StepPlan, objective: ObjectiveConfig
                   ) -> tuple[dict[str, float], dict[str, torch.Tensor] | None]:
        """Collective, no update: the step's sums under ``objective`` and, on rank 0, the
        full summed fp64 gradient of every HF parameter (what the optimizer would see,
        gathered over TP); grads are cleared.

        Keys are those of the HF model's ``named_parameters()``: a tied model has no
        ``lm_head.weight`` (its gradient is part of the embeddings')."""
        with self.objective_for_call(objective):
            sums = self.forward_backward(batch, plan)
        grads = self.weights.gather({name: p.grad if p.grad is not None else torch.zeros_like(p)
                                     for name, p in self.weights.params.items()})
        self.main.zero_grad()
        if self.rank != 0:
            return sums, None
        if self.shape.tied_embeddings:
            grads.pop(HF_TIED_HEAD, None)
        return sums, {name: g.double() for name, g in grads.items()}

    def optimizer_step(self) -> dict[str, float]:
        norm = float(grad_norm(self.weights.params, self.weights.tp_sharded,
                               self.weights.tp_rank, self.tp_group, self.config.tp_size))
        clip_gradients(self.params, norm, self.config.optimizer.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.main.copy_to_model()
        self.scheduler.step()
        return {"grad_norm": norm, "lr": lr}

    def _build_optimizer(self) -> None:
        """AdamW (or SGD) and its schedule over the fp32 main params."""
        self.optimizer = build_optimizer(self.params, self.config.optimizer)
        self.scheduler = build_scheduler(self.optimizer, self.config.optimizer,
                                         self.total_steps)

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective; rank 0 returns the full Hugging Face state dict of the main params
        (fp32: engines never see weights rounded to the compute dtype), others None."""
        return self.weights.export()

    def load_weights(self, state_dict: dict[str, torch.Tensor] | None) -> None:
        """Collective; rank 0 passes the full HF state dict, the others None."""
        self.weights.load(state_dict if self.rank == 0 else None)
        self.main.copy_to_model()

    def save_checkpoint(self, path: str) -> None:
        """Collective; rank 0 writes the main params (HF safetensors) and trainer state."""
        megatron_checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Collective; rank 0 reads, every rank takes its slices."""
        megatron_checkpoint.load(self, path)
