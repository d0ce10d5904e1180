"""The trainer rank (a Ray actor): the verbs every backend answers, and what every rank
does the same way around them.

    group (driver)                     every rank                    backend
    rendezvous_address ─► rank 0 ───── hosts the store
    setup(addr, port) ──► all ranks ── _join_process_group ────────► setup (model, optimizer)
    train_step ─────────► all ranks ── forward_backward + optimizer_step (+ timing, memory)
    gradients ──────────► all ranks ── _gradients for each objective
    export_weight_buckets ► all ranks ─ weight_buckets, rank 0 puts each in the object store
    checkpoint ─────────► all ranks ── save_checkpoint (+ memory)
    export_with_receipt ► all ranks ── export_weights / export_engine_weights (tests, verify)

Every verb that moves weights reports this rank's peak memory in its phase
(``perf/peak_mem_gb/<phase>``, trainer/memory.py).

Backends (``backends/fsdp``, ``backends/megatron``) subclass :class:`TrainerWorker` and
implement its abstract verbs; each keeps its own rank layout (``dp_rank``, ``cp_rank``),
set in ``setup``. The group (``trainer/group.py``) names verbs by these methods, never by
strings, and stops a rank by killing its actor (a rank stuck in a collective could not
answer).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rollout.weight_bucket import DTYPES
from trainer.config import LossConfig, ObjectiveConfig, TrainerConfig
from trainer.memory import PeakMemory, phase_metrics
from trainer.rank import init_rank, open_store
from trainer.session_calls import SessionCalls

if TYPE_CHECKING:
    from rollout.batch import RolloutBatch
    from rollout.weight_bucket import TensorSpec
    from trainer.step_plan import StepPlan


def in_eval_mode(verb: Callable[..., Any]) -> Callable[..., Any]:
    """A verb that only reads the policy (the old log-probs) runs it in eval mode, dropout
    off, so π_old is π itself and two calls agree; train mode is restored after."""
    @functools.wraps(verb)
    def run(self: TrainerWorker, *args: Any, **kwargs: Any) -> Any:
        self.model.eval()
        try:
            return verb(self, *args, **kwargs)
        finally:
            self.model.train()
    return run


class TrainerWorker(SessionCalls, abc.ABC):
    """One rank of the trainer group; its public methods are the verbs the group calls
    (a session's transactional ``forward_backward_call`` / ``commit_call`` /
    ``restore_call``: trainer/session_calls.py)."""

    dp_rank: int
    cp_rank: int
    device: torch.device
    compute_dtype: torch.dtype

    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 rank: int, total_steps: int) -> None:
        self.config, self.objective, self.model_path = config, objective, model_path
        self.rank, self.total_steps = rank, total_steps
        self._store: dist.TCPStore | None = None

    # Rendezvous: the verbs a rank answers before its process group exists.

    def rendezvous_address(self, host: str | None = None) -> tuple[str, int]:
        """Rank 0, before ``setup``: host the process group's store on a port the OS picks
        (bound here and kept open: no other process can take it before the peers join)
        and say where it listens; ``host`` defaults to this actor's node address."""
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self._store = open_store(self.config, self.rank, host, 0)
        return host, self._store.port

    def node_id(self) -> str:
        """The Ray node this rank runs on (the driver colocates engines by it)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def _join_process_group(self, master_addr: str, master_port: int) -> torch.device:
        """Join the world process group at rank 0's store: the one ``rendezvous_address``
        opened, or (rank 0 without it, e.g. in a test) one hosted at ``master_port``."""
        if self._store is None:
            self._store = open_store(self.config, self.rank, master_addr, master_port)
        return init_rank(self.config, self.rank, self._store)

    # Verbs every backend shares.

    def train_step(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Collective: one optimizer step on this rank's micro-batches of ``plan``; the
        step's exact sums, its grad norm and lr, and this rank's compute time."""
        started = time.perf_counter()
        with PeakMemory(self.device) as peak:
            sums = self.forward_backward(batch, plan)
            sums.update(self.optimizer_step())
        sums["padding_fraction"] = plan.padding_fraction
        sums["perf/trained_tokens"] = float(plan.computed_tokens)  # all ranks' rows
        sums["perf/compute_s"] = time.perf_counter() - started  # rank-local fwd+bwd+step
        return {**sums, **phase_metrics("train", peak)}

    def checkpoint(self, path: str) -> dict[str, float]:
        """Collective: ``save_checkpoint``; this rank's time and peak memory."""
        started = time.perf_counter()
        with PeakMemory(self.device) as peak:
            self.save_checkpoint(path)
        return {"perf/checkpoint_s": time.perf_counter() - started,
                **phase_metrics("checkpoint", peak)}

    def export_weight_buckets(self, dtype: str, bucket_mb: float
                              ) -> tuple[dict[str, float], list[Any] | None]:
        """Collective: (this rank's sync time and peak memory, rank 0's list of object refs
        of its buckets) as two Ray returns. Rank 0 puts each bucket in the object store as
        soon as it is packed and drops its own copy, so it never holds two."""
        import ray

        from rollout.weight_bucket import WeightBucket

        started, refs = time.perf_counter(), []
        plan = self.weight_bucket_specs(dtype, bucket_mb)
        with PeakMemory(self.device) as peak:
            for specs, flat in zip(plan, self.weight_buckets(dtype, bucket_mb), strict=True):
                if flat is not None:
                    refs.append(ray.put(WeightBucket(specs, flat.numpy())))
                del flat
        sent = float(sum(spec.num_bytes for bucket in plan for spec in bucket))
        receipt = {"perf/export_s": time.perf_counter() - started,
                   "perf/sync_bytes": sent, **phase_metrics("sync", peak)}
        if (whole := self.full_model_bytes(dtype)) is not None:  # adapters only (LoRA)
            receipt["perf/sync_share_of_full"] = sent / whole
        return receipt, refs if self.rank == 0 else None

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

    def gradients(self, batch: RolloutBatch, plans: list[StepPlan],
                  objectives: list[ObjectiveConfig]) -> list[tuple[dict[str, float], Any]]:
        """Collective, no update: for each (plan, objective), the step's sums and, on rank
        0, the full summed gradient of every parameter (what the optimizer would see)."""
        return [self._gradients(batch, plan, objective)
                for plan, objective in zip(plans, objectives, strict=True)]

    @contextlib.contextmanager
    def objective_for_call(self, objective: ObjectiveConfig) -> Iterator[None]:
        """Run one call under ``objective`` instead of the configured one."""
        configured, self.objective = self.objective, objective
        try:
            yield
        finally:
            self.objective = configured

    def export_engine_weights(self) -> dict[str, Any] | None:
        """Collective: ``export_weights`` with each tensor as a numpy array (bf16 stays a
        tensor), so Ray keeps it in shared memory once and an engine on the node reads
        it in place; torch tensors are pickled and copied on both sides (SmolLM2, 540 MB:
        0.2 s instead of 2.9 s)."""
        state = self.export_weights()
        if state is None:
            return None
        return {name: tensor.numpy() if tensor.dtype != torch.bfloat16 else tensor
                for name, tensor in state.items()}

    def export_with_receipt(self, for_engines: bool) -> tuple[None, dict[str, Any] | None]:
        """Collective: (a receipt, rank 0's weights) as two Ray returns. The group waits on
        the small receipt (an error there says this rank died or failed) and hands the
        weights on by reference, never fetching them into the driver."""
        return None, self.export_engine_weights() if for_engines else self.export_weights()

    # GPU weight transports (trainer/weight_broadcast.py): rank 0 meets the SGLang servers.

    def weight_group_address(self) -> tuple[str, int]:
        """Rank 0: where the weight-update group's rendezvous will listen (this node, a
        port free now: rank 0 binds it in ``join_weight_group``)."""
        import socket

        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_weight_group(self, address: str, port: int, world_size: int,
                          group_name: str) -> None:
        """Rank 0: host and join the group while the servers join it."""
        from trainer.weight_broadcast import init_weight_update_group

        self._weight_group = init_weight_update_group(
            address, port, world_size, group_name,
            timeout_s=self.config.collective_timeout_s)

    def broadcast_weight_buckets(self, dtype: str, bucket_mb: float) -> dict[str, float]:
        """Collective: each bucket packed on rank 0's GPU and broadcast to the servers as
        one flattened tensor (their /update_weights_from_distributed receives it)."""
        from trainer.weight_broadcast import broadcast_bucket

        started = time.perf_counter()
        with PeakMemory(self.device) as peak:
            for flat in self.weight_buckets(dtype, bucket_mb, device=str(self.device)):
                if flat is not None:
                    broadcast_bucket(self._weight_group, [flat], flattened=True)
                del flat
        return {"perf/export_s": time.perf_counter() - started, **phase_metrics("sync", peak)}

    def share_weight_bucket(self, index: int, dtype: str, bucket_mb: float, tp_size: int
                            ) -> tuple[list[str] | None, dict[str, float]]:
        """Collective: bucket ``index`` packed on rank 0's GPU and kept alive there; its
        CUDA IPC handles for /update_weights_from_tensor (rank 0; None elsewhere)."""
        from trainer.weight_broadcast import serialize_named_tensors

        if index == 0:
            self._sharing = zip(self.weight_bucket_specs(dtype, bucket_mb),
                                self.weight_buckets(dtype, bucket_mb, str(self.device)),
                                strict=True)
        self._shared = None  # the server copied the previous bucket: free it first
        with PeakMemory(self.device) as peak:
            specs, self._shared = next(self._sharing)
        if self._shared is None:
            return None, phase_metrics("sync", peak)
        views = [(spec.name, self._shared[spec.offset:spec.offset + spec.num_bytes]
                  .view(DTYPES[spec.dtype]).view(spec.shape)) for spec in specs]
        return serialize_named_tensors(views, tp_size), phase_metrics("sync", peak)

    def release_shared_bucket(self) -> None:
        """Rank 0: the last shared bucket is loaded; free it."""
        self._shared = None

    # The training API's verbs (services/sessions): gradients accumulated over calls.

    def use_loss(self, loss: LossConfig) -> None:
        """The loss terms of the calls that follow (a session's ``loss_fn``); the KL
        coefficient stays the configured one (it decided the reference model)."""
        self.config = self.config.model_copy(update={"loss": loss.model_copy(
            update={"kl_coef": self.config.loss.kl_coef})})

    def forward_only(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Collective, no gradient: the sums ``forward_backward`` would return."""
        raise NotImplementedError(f"training sessions need trainer.backend: fsdp, not "
                                  f"{self.config.backend}")

    def apply_gradients(self, scale: float, adam: dict[str, Any], grad_clip: float | None
                        ) -> dict[str, float]:
        """Collective: the gradients ``forward_backward`` calls accumulated, times
        ``scale`` (the step's 1/ΣD, trainer/aggregation.py), clipped to ``grad_clip``,
        then one optimizer step with ``adam``'s settings (lr, betas, eps, weight_decay;
        no schedule); returns ``grad_norm`` (scaled, before clipping) and ``lr``."""
        raise NotImplementedError(f"training sessions need trainer.backend: fsdp, not "
                                  f"{self.config.backend}")

    def discard_gradients(self) -> None:
        """Drop the accumulated gradients (a session restored from a save)."""
        raise NotImplementedError(f"training sessions need trainer.backend: fsdp, not "
                                  f"{self.config.backend}")

    def values(self, batch: RolloutBatch, plan: StepPlan) -> torch.Tensor | None:
        """Collective, no update: the critic's V [N, S] of every response token, rank 0
        (trainer/backends/fsdp/critic.py); a policy rank has none."""
        raise NotImplementedError("values: a policy rank has log-probs; the critic's "
                                  "ranks have values")

    # Backend verbs.

    @abc.abstractmethod
    def setup(self, master_addr: str, master_port: int) -> None:
        """Collective: join the process group (``_join_process_group``), set this rank's
        layout (``dp_rank``, ``cp_rank``), build the model, the reference model when
        ``loss.kl_coef > 0``, the optimizer and its schedule."""

    @abc.abstractmethod
    def forward_backward(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Collective: Σ w·ℓ over this rank's tokens of ``plan``, backpropagated and
        summed over DP×CP; returns the step's exact terms (``objective.step_metrics``)."""

    @abc.abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Clip, step and zero the gradients and advance the schedule; returns
        ``grad_norm`` (before clipping) and the ``lr`` the step used."""

    @abc.abstractmethod
    def log_probs(self, batch: RolloutBatch, plan: StepPlan) -> torch.Tensor | None:
        """Collective, no update: log π_T [N, S] of every response token under the current
        policy, aligned with ``input_ids`` and 0 off the loss mask; rank 0 returns it."""

    @abc.abstractmethod
    def _gradients(self, batch: RolloutBatch, plan: StepPlan, objective: ObjectiveConfig
                   ) -> tuple[dict[str, float], dict[str, torch.Tensor] | None]:
        """Collective, no update: one step's sums under ``objective`` and, on rank 0, the
        full summed fp64 gradient of every HF parameter; the gradients are cleared."""

    @abc.abstractmethod
    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective: rank 0 returns the full Hugging Face state dict of the weights the
        optimizer steps (never rounded to the compute dtype), the others None."""

    @abc.abstractmethod
    def load_weights(self, state_dict: dict[str, torch.Tensor] | None) -> None:
        """Collective: rank 0 passes the full HF state dict, the others None."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Collective: the weights (HF safetensors) and the trainer state at ``path``."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Collective: restore what ``save_checkpoint`` wrote (rank 0 reads)."""
