"""The policy's rank: the head that owns log π_T and the pg/KL/entropy terms
(trainer/objective.py), and the policy's weights out to the engines.

    log_probs(batch, plan)   ► all ranks ─ log π_T [N, S] on rank 0 (old log-probs)
    token_stats(batch, plan) ► all ranks ─ (log π_T, H(π_T)) [N, S] on rank 0 (the
                                 per-token view of logged samples, samples.jsonl)

    send_weights(step, sender) ► all ranks (or rank 0) ─ a transport's step on this rank
                                 (trainer/transports/: object store, NCCL, CUDA IPC),
                                 reading the buckets of weight_buckets

Backends: ``backends/fsdp/worker.py`` (FSDPWorker), ``backends/megatron/worker.py``.
"""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer.transports.base import SenderStep
from trainer.worker import BatchRank, in_eval_mode

if TYPE_CHECKING:
    from rollout.batch import RolloutBatch
    from rollout.weight_bucket import TensorSpec
    from trainer.step_plan import StepPlan


class PolicyRank(BatchRank):
    """A rank of the policy: log-probs and the weight sync's buckets and senders."""

    @torch.no_grad()
    @in_eval_mode
    def log_probs(self, batch: RolloutBatch, plan: StepPlan) -> torch.Tensor | None:
        """Collective, no update: log π_T [N, S] of every response token under the current
        policy (a rollout's old log-probs), aligned with ``input_ids`` and 0 off the loss
        mask; rank 0 returns it. Same precision and temperature as the loss; eval mode
        (in_eval_mode: dropout off)."""
        out = self._gathered(batch, plan, with_entropy=False)
        return None if out is None else out[0]

    @torch.no_grad()
    @in_eval_mode
    def token_stats(self, batch: RolloutBatch, plan: StepPlan
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Collective, no update: (log π_T, H(π_T)) [N, S] of every response token under
        the current policy, H_t = −Σ_v π_T(v) log π_T(v) at the position that predicts
        token t (trainer/losses/log_probs.py), both computed as :meth:`log_probs` is (same
        precision, temperature, layout, eval mode), aligned with ``input_ids`` and 0 off
        the loss mask; rank 0 returns them."""
        out = self._gathered(batch, plan, with_entropy=True)
        return None if out is None else (out[0], out[1])

    @abc.abstractmethod
    def _gathered(self, batch: RolloutBatch, plan: StepPlan, with_entropy: bool
                  ) -> list[torch.Tensor] | None:
        """The backend's part: log π_T (and, ``with_entropy``, H(π_T)) of every response
        token, [N, S] each, gathered over its DP/CP/TP layout; rank 0 returns them."""

    @torch.no_grad()
    def reference_log_probs(self, batch: RolloutBatch, plan: StepPlan
                            ) -> torch.Tensor | None:
        """Collective, no update: log π_ref,T [N, S] of every response token under the
        frozen reference (the KL in the reward's k1, rollout/kl_reward.py), as
        :meth:`log_probs` computes π_T's (same precision, temperature, layout); rank 0
        returns it. Needs the reference, loaded when ``kl_coef > 0``."""
        with self._reference() as reference:
            # Each backend's log_probs reads self.model: the reference stands in for the
            # call, its own train/eval mode restored after (log_probs sets eval, then train).
            policy, was_training = self.model, reference.training
            self.model = reference
            try:
                return self.log_probs(batch, plan)
            finally:
                self.model = policy
                reference.train(was_training)

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The KL reference: the rank's frozen copy (``ref_model``); a backend whose
        reference is something else (FSDP's LoRA base, adapters off) overrides it."""
        reference = getattr(self, "ref_model", None)
        if reference is None:
            raise RuntimeError("no reference model on this rank: the KL's reference is "
                               "loaded when trainer.loss.kl_coef > 0")
        yield reference

    def send_weights(self, step: SenderStep, sender: Any, *args: Any) -> Any:
        """One step of a weight transport's rank side (trainer/transports/): ``step``
        called with the sender this rank holds for ``sender``'s settings (the first equal
        one it got, so what the transport keeps between calls stays here), this rank and
        ``args``. Collective or rank 0's alone, as the step says."""
        held = self._senders.setdefault(sender, sender)
        return step(held, self, *args)

    @functools.cached_property
    def _senders(self) -> dict[Any, Any]:
        return {}

    def full_model_bytes(self, dtype: str) -> float | None:
        """What a sync of the whole model in ``dtype`` would send, where a sync sends less
        (LoRA's adapters); None where it sends the whole model."""
        return None

    def weight_bucket_specs(self, dtype: str, bucket_mb: float
                            ) -> list[tuple[TensorSpec, ...]]:
        """The buckets of one sync, in send order (the same on every rank)."""
        from rollout.weight_bucket import plan_buckets

        shapes = self._weight_shapes()
        return plan_buckets(shapes, dtype, int(bucket_mb * 2**20))

    def _weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        if not hasattr(self, "_gathered_shapes"):  # the backend gathers to learn them once
            state = self.export_weights()
            holder = [None if state is None else [(n, tuple(t.shape))
                                                  for n, t in state.items()]]
            dist.broadcast_object_list(holder, src=0)
            self._gathered_shapes = holder[0]
        return self._gathered_shapes

    def weight_buckets(self, dtype: str, bucket_mb: float, device: str = "cpu"
                       ) -> Iterator[torch.Tensor | None]:
        """Collective: the flat buckets of ``weight_bucket_specs`` in order, on rank 0
        (None elsewhere). This default gathers the whole model on rank 0 first
        (``export_weights``: the Megatron backend); FSDP streams a bucket at a time."""
        from rollout.weight_bucket import pack_flat

        specs = self.weight_bucket_specs(dtype, bucket_mb)
        state = self.export_weights()
        for bucket in specs:
            yield None if state is None else pack_flat(bucket, state.__getitem__, device)
