"""The policy's FSDP2 rank (a Ray actor): the policy head on ``FSDPRank``
(backends/fsdp/rank.py: process group, sharding, optimizer, checkpoints).

Every rank of a DP group sees the same samples (``plan.micro_batches[dp_rank]``); its CP
rank keeps the zigzag shard of each sequence (``trainer/micro_batch.py``). The head only
produces log-probs and entropy of π_T; ``trainer/objective.py`` turns them into the loss
and the logged sums.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from rollout.batch import RolloutBatch
from rollout.weight_bucket import DTYPES, TensorSpec, pack_flat, plan_buckets
from trainer import lora
from trainer.aggregation import sum_reduction_factor
from trainer.backends.fsdp import bucket_gather
from trainer.backends.fsdp import model as fsdp
from trainer.backends.fsdp.rank import FSDPRank
from trainer.config import ObjectiveConfig
from trainer.losses import log_probs_and_entropy, loss_positions, spread, token_log_probs
from trainer.micro_batch import MicroBatch, gather_log_probs, slice_for_plan
from trainer.objective import (
    TokenLogProbs,
    micro_batch_objective,
    planted_loss_mask,
    step_metrics,
    term_coefficients,
)
from trainer.policy_rank import PolicyRank
from trainer.step_plan import StepPlan


class FSDPWorker(PolicyRank, FSDPRank):
    """The policy's head on the FSDP2 rank (``FSDPRank``): log π_T and entropy at the
    loss mask's positions, the objective's pg/KL/entropy terms, the weight sync's
    buckets, and (a ``WeightSource``, trainer/transports/base.py) its full tensors by name
    for a colocated engine."""

    def _build_models(self) -> None:
        self.model = self._build()
        # Under LoRA the reference is the same base with its adapters disabled.
        self.ref_model = (self._build() if self.config.loss.kl_coef > 0
                          and self.config.lora is None
                          else None)
        if self.ref_model is not None:
            self.ref_model.requires_grad_(False)

    def _build(self) -> torch.nn.Module:
        model = fsdp.load_model(self.model_path, self.compute_dtype, self.device)
        if self.config.lora is not None:
            model = lora.add_adapters(model, self.config.lora, self.compute_dtype)
        self.attention = fsdp.configure_attention(model, self.config, self.compute_dtype)
        return fsdp.shard_model(model, self.compute_dtype, self.config.world_size)

    def _logits(self, model: torch.nn.Module, micro: MicroBatch, keep: torch.Tensor
                ) -> torch.Tensor:
        """Logits [n, V] at the n positions ``keep`` [b, s] marks: the LM head, and the
        log-softmax after it, never see a prompt or padding position."""
        return self._forward(model, micro, logits_to_keep=keep).logits

    def _token_log_probs(self, micro: MicroBatch) -> TokenLogProbs:
        """log π_T(target) and H(π_T) of the policy (and π_ref,T) at fp32 or better, at
        the loss mask's positions (0 elsewhere)."""
        temperature = self.objective.temperature
        # the loss mask, but in a test that plants observation_tokens
        keep = loss_positions(planted_loss_mask(micro, self.planted))
        targets = micro.targets[keep]
        log_probs, entropy = log_probs_and_entropy(
            self._logits(self.model, micro, keep), targets, temperature,
            with_entropy_grad=term_coefficients(self.config.loss,
                                                self.objective.gradient_of)["entropy"] > 0)
        ref = None
        if self.config.loss.kl_coef > 0:  # its own reference, or LoRA's base
            with torch.no_grad(), self._reference() as reference:
                ref = spread(token_log_probs(self._logits(reference, micro, keep),
                                             targets, temperature), keep)
        return TokenLogProbs(spread(log_probs, keep), spread(entropy, keep), ref)

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The KL reference model: its own copy, or the LoRA base with adapters off."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        with self.model.disable_adapter():
            yield self.model

    def forward_backward(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Σ w·ℓ over this rank's tokens, backpropagated; returns the step's exact terms."""
        return self._objective_sums(batch, plan, backward=True)

    def _objective_sums(self, batch: RolloutBatch, plan: StepPlan, backward: bool
                        ) -> dict[str, float]:
        scale = sum_reduction_factor(self.config.world_size)  # FSDP averages; we SUM
        mode_names = plan.mode_metric_names
        # a sample's sequence sums (GSPO, sequence corrections) span its CP shards
        cp_group = self.cp_group if self.config.cp_size > 1 else None
        totals = None
        self.model.train()
        for samples in plan.micro_batches[self.dp_rank]:
            micro = slice_for_plan(batch, plan, samples, self.config.cp_size,
                                   self.cp_rank, self.planted).to(self.device)
            objective, sums = micro_batch_objective(self._token_log_probs(micro), micro,
                                                    self.config.loss, mode_names,
                                                    self.planted,
                                                    self.objective.gradient_of, cp_group)
            if backward:
                (objective * scale).backward()
            totals = sums.cpu() if totals is None else totals + sums.cpu()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every token is owned by one rank
        return step_metrics(totals, mode_names)

    def _gathered(self, batch: RolloutBatch, plan: StepPlan, with_entropy: bool
                  ) -> list[torch.Tensor] | None:
        """log π_T (and H(π_T)) of every response token, [N, S] each, gathered from DP
        ranks' micro-batches and CP shards; rank 0 returns them."""
        temperature = self.objective.temperature
        outs = [torch.zeros(batch.input_ids.shape, dtype=torch.float32)
                for _ in range(2 if with_entropy else 1)]
        for samples in plan.micro_batches[self.dp_rank]:
            micro = slice_for_plan(batch, plan, samples, self.config.cp_size,
                                   self.cp_rank, self.planted).to(self.device)
            keep = loss_positions(micro.loss_mask)
            logits, targets = self._logits(self.model, micro, keep), micro.targets[keep]
            values = (log_probs_and_entropy(logits, targets, temperature,
                                            with_entropy_grad=False) if with_entropy
                      else (token_log_probs(logits, targets, temperature),))
            for value, out in zip(values, outs, strict=True):
                gather_log_probs(batch, samples, spread(value, keep), out, self.cp_group,
                                 self.config.cp_size, owner=self.cp_rank == 0,
                                 packed=plan.packed, prefix_skip=plan.prefix_skip)
        for out in outs:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)  # each sample written by one rank
        return outs if self.rank == 0 else None

    def _gradients(self, batch: RolloutBatch, plan: StepPlan, objective: ObjectiveConfig
                   ) -> tuple[dict[str, float], dict[str, torch.Tensor] | None]:
        with self.objective_for_call(objective):
            sums = self.forward_backward(batch, plan)
        return sums, self._summed_gradients()

    def weight_buckets(self, dtype: str, bucket_mb: float, device: str = "cpu"
                       ) -> Iterator[torch.Tensor | None]:
        """Collective, one bucket at a time, rank 0's flat bucket on ``device`` (None
        elsewhere): the whole weights by one gather per bucket of every rank's rows, cast
        first (bucket_gather.py); LoRA's adapters (small) each gathered, cast and copied
        in, then freed."""
        if self.config.lora is None:
            owned = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
            if not hasattr(self, "_shard_rows"):  # the layout never changes: asked once
                self._shard_rows = bucket_gather.shard_rows(owned, self.config.world_size)
                self._gathers: dict[tuple[str, float], list[bucket_gather.BucketGather]] = {}
            if (dtype, bucket_mb) not in self._gathers:
                self._gathers[dtype, bucket_mb] = bucket_gather.plan_gathers(
                    owned, self.weight_bucket_specs(dtype, bucket_mb), self._shard_rows,
                    self.config.world_size)
            yield from bucket_gather.gather_buckets(owned, self._gathers[dtype, bucket_mb],
                                                    self.rank, device)
            return
        full = self._sync_tensors()
        for specs in self.weight_bucket_specs(dtype, bucket_mb):
            if self.rank == 0:
                yield pack_flat(specs, full, device)
            else:
                for spec in specs:
                    full(spec.name)
                yield None

    def weight_bucket_specs(self, dtype: str, bucket_mb: float
                            ) -> list[tuple[TensorSpec, ...]]:
        if not hasattr(self, "_wire_shapes"):  # the names and shapes never change
            self._wire_shapes = (lora.wire_shapes(self.model) if self.config.lora is not None
                                 else fsdp.weight_shapes(self.model))
        return plan_buckets(self._wire_shapes, dtype, int(bucket_mb * 2**20))

    def full_model_bytes(self, dtype: str) -> float | None:
        if self.config.lora is None:
            return None
        if not hasattr(self, "_base_numel"):  # the shapes never change: counted once
            self._base_numel = sum(math.prod(shape) for name, shape in
                                   fsdp.weight_shapes(self.model) if ".lora_" not in name)
        return float(self._base_numel * DTYPES[dtype].itemsize)

    def _sync_tensors(self) -> Callable[[str], torch.Tensor]:
        """Collective per call: name -> one tensor of a sync, whole: a weight or
        persistent buffer, or under LoRA an adapter's A or s·B (rollout/adapters.py)."""
        if self.config.lora is None:
            owned = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
            return functools.partial(fsdp.full_tensor, owned)
        sources = lora.wire_sources(self.model)

        def scaled(name: str) -> torch.Tensor:
            param, scale = sources[name]
            full = fsdp.unsharded(param)
            return full * scale if scale != 1.0 else full

        return scaled

    def engine_tensors(self, alias: bool, gather: bool = True
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter once (a tied head is its embedding) and every buffer (the
        rotary tables too: an engine built empty has none): the full tensor, gathered
        when ``gather``; ``alias`` (one rank): the shard's own storage, which is all of it."""
        owned = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        if gather and not alias:
            yield from fsdp.full_tensors(self.model, owned)
            return
        for name, tensor in owned.items():
            tensor = tensor.detach()
            if alias:
                assert self.config.world_size == 1, "only one rank's shard is the whole"
            yield name, tensor.to_local() if hasattr(tensor, "to_local") else tensor

