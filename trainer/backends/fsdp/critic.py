"""One FSDP2 rank of the critic (a Ray actor): the value head on ``FSDPRank`` (the
machinery every role's rank shares, backends/fsdp/rank.py).

The critic is a trainer group of its own in the job's gang, built from ``critic:``: its
own ranks (DP × CP), optimizer, schedule and checkpoint shards. Its model is
``AutoModelForTokenClassification`` with one label (the policy's decoder and a fresh
value head by default: ``backends/fsdp/value_model.py``); V_it is the head's
output at the position before token t, where the policy's logits for token t are. Two
verbs differ from the policy rank's: ``values`` (V of every response token, gathered
back into the batch's layout) and the objective of ``forward_backward``, the clipped
value loss of ``trainer/value_loss.py`` under the critic's aggregation mode. Rows,
packing, shared prefixes and CP shards are the policy's (``trainer/micro_batch.py``).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from rollout.batch import RolloutBatch
from trainer.aggregation import sum_reduction_factor
from trainer.backends.fsdp import model as fsdp
from trainer.backends.fsdp.rank import FSDPRank
from trainer.backends.fsdp.value_model import load_value_model
from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.micro_batch import MicroBatch, gather_log_probs, slice_for_plan
from trainer.step_plan import StepPlan
from trainer.value_loss import (
    PLANTED_VALUE_ERROR,
    VALUE_SUMS,
    micro_batch_value_objective,
    value_step_metrics,
)
from trainer.worker import BatchRank, in_eval_mode

# FSDP2 warns when a wrapped root returns a view (the token classifier's output); the
# warning is about in-place ops on that view skipping its pre-backward hook, and the
# critic never writes to its output (it reads ``logits[..., 0]`` out of place).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class FSDPCriticWorker(BatchRank, FSDPRank):
    """The critic's rank: ``FSDPRank`` with a value model, its values and the value
    loss; it has no log-probs and takes no session calls (those are the policy's)."""

    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 rank: int, total_steps: int, value_clip: float | None = 0.2) -> None:
        if config.lora is not None or config.loss.kl_coef > 0:
            raise ValueError("critic: its trainer config has no LoRA and no KL term")
        super().__init__(config, objective, model_path, rank, total_steps)
        self.value_clip = value_clip

    def _build(self) -> torch.nn.Module:
        model = load_value_model(self.model_path, self.compute_dtype, self.device)
        self.attention = fsdp.configure_attention(model, self.config, self.compute_dtype)
        return fsdp.shard_model(model, self.compute_dtype, self.config.world_size)

    def _values(self, micro: MicroBatch) -> torch.Tensor:
        """V [b, s] at every position of the shard (the head is one number wide: no
        position is worth skipping), float32 or better."""
        values = self._forward(self.model, micro).logits[..., 0]
        return values if values.dtype == torch.float64 else values.float()

    def forward_backward(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Σ w·ℓ of the value loss over this rank's tokens, backpropagated (gradients
        summed over DP × CP); the step's exact sums."""
        scale = sum_reduction_factor(self.config.world_size)  # FSDP averages; we SUM
        planted = PLANTED_VALUE_ERROR in self.planted  # a test's (trainer/planted.py)
        totals = torch.zeros(len(VALUE_SUMS), dtype=torch.float64)
        self.model.train()
        for samples in plan.micro_batches[self.dp_rank]:
            micro = slice_for_plan(batch, plan, samples, self.config.cp_size,
                                   self.cp_rank, self.planted).to(self.device)
            objective, sums = micro_batch_value_objective(self._values(micro), micro,
                                                          self.value_clip, planted)
            (objective * scale).backward()
            totals += sums.cpu()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every token is owned by one rank
        return value_step_metrics(totals)

    @torch.no_grad()
    @in_eval_mode
    def values(self, batch: RolloutBatch, plan: StepPlan) -> torch.Tensor | None:
        """Collective, no update: V [N, S] of every response token (m > 0) under the
        current critic, aligned with ``input_ids``, 0 elsewhere; rank 0 returns it."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for samples in plan.micro_batches[self.dp_rank]:
            micro = slice_for_plan(batch, plan, samples, self.config.cp_size,
                                   self.cp_rank, self.planted).to(self.device)
            gather_log_probs(batch, samples, self._values(micro), out, self.cp_group,
                             self.config.cp_size, owner=self.cp_rank == 0,
                             packed=plan.packed, prefix_skip=plan.prefix_skip)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)  # each sample written by one rank
        return out if self.rank == 0 else None

    def _gradients(self, batch: RolloutBatch, plan: StepPlan, objective: ObjectiveConfig
                   ) -> tuple[dict[str, float], dict[str, torch.Tensor] | None]:
        """Collective, no update: the value loss's sums under ``objective`` and, on rank
        0, every parameter's gradient summed over DP × CP (the verifier's check)."""
        with self.objective_for_call(objective):
            sums = self.forward_backward(batch, plan)
        return sums, self._summed_gradients()
