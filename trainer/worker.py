"""The trainer rank (a Ray actor): what every rank does, whatever its role.

    group (driver)                     every rank                    backend
    rendezvous_address ─► rank 0 ───── hosts the store
    setup(addr, port) ──► all ranks ── _join_process_group ────────► setup (model, optimizer)
    checkpoint ─────────► all ranks ── save_checkpoint (+ memory)
    export_with_receipt ► all ranks ── export_weights (tests, verify, a state-dict copy)
    rebuild ────────────► all ranks ── leave the group, forget all, __init__ (verify's pool)

Ranks are roles. :class:`TrainerRank` is the base: build, step the optimizer, save and
load shards, weights in and out, memory. A role is a small head that owns its model's
output and its loss, and adds only its own verbs:

    BatchRank (here): train_step and gradients on a rollout under a step plan
      ├─ PolicyRank  (trainer/policy_rank.py): log-probs; pg/KL/entropy; weight sync
      └─ critic      (backends/fsdp/critic.py): values; the value loss
    score: the reward model (backends/fsdp/reward_model.py): pairs, Bradley–Terry

Every verb that moves weights reports this rank's peak memory in its phase
(``perf/peak_mem_gb/<phase>``, trainer/memory.py). Backends (``backends/fsdp``,
``backends/megatron``) implement the abstract verbs and keep their own rank layout
(``dp_rank``, ``cp_rank``), set in ``setup``. The group (``trainer/rank_group.py``) names
verbs by these methods, never by strings, and stops a rank by killing its actor (a rank
stuck in a collective could not answer).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import gc
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.memory import PeakMemory, phase_metrics
from trainer.planted import NOTHING_PLANTED, Planted, rank_planted
from trainer.rank import init_rank, open_store

if TYPE_CHECKING:
    from rollout.batch import RolloutBatch
    from trainer.step_plan import StepPlan


def in_eval_mode(verb: Callable[..., Any]) -> Callable[..., Any]:
    """A verb that only reads the policy (the old log-probs) runs it in eval mode, dropout
    off, so π_old is π itself and two calls agree; train mode is restored after."""
    @functools.wraps(verb)
    def run(self: TrainerRank, *args: Any, **kwargs: Any) -> Any:
        self.model.eval()
        try:
            return verb(self, *args, **kwargs)
        finally:
            self.model.train()
    return run


class TrainerRank(abc.ABC):
    """One rank of a trainer group: the verbs every role's rank answers."""

    dp_rank: int
    cp_rank: int
    device: torch.device
    compute_dtype: torch.dtype

    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 rank: int, total_steps: int) -> None:
        self.config, self.objective, self.model_path = config, objective, model_path
        self.rank, self.total_steps = rank, total_steps
        self._store: dist.TCPStore | None = None
        self.planted: Planted = NOTHING_PLANTED
        """The errors this rank makes (trainer/planted.py): none, unless a verifier's
        test injected some (``plant``); handed as a parameter to what makes each."""

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

    # Verbs every role shares.

    def plant(self, planted: Planted) -> None:
        """Verify-only, after ``setup`` and before any step: make this layout's
        ``planted`` errors (a test's, trainer/planted.py), this rank's share of them (all
        on a rank of the first DP×CP shard, every TP rank of it included)."""
        self.planted = rank_planted(planted, first_shard=self.dp_rank == 0
                                    and self.cp_rank == 0)

    def rebuild(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                total_steps: int, role_kwargs: dict[str, Any]) -> None:
        """Verify-only: become a new rank of another layout of the same world size in this
        process (the verifier's pool, trainer/verify.py), sparing the process start and
        its imports. Leaves the process group and every subgroup of the last layout and
        forgets everything this rank built or was planted with (every attribute, then
        ``__init__`` anew with ``role_kwargs``, the role's), so the group's next
        ``rendezvous_address`` and ``setup`` build it as in a new actor."""
        if dist.is_initialized():
            dist.destroy_process_group()  # the world group and every subgroup made from it
        rank = self.rank
        for name in list(vars(self)):
            delattr(self, name)
        gc.collect()  # the last layout's model and optimizer, before the next is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        type(self).__init__(self, config, objective, model_path, rank, total_steps,
                            **role_kwargs)

    def checkpoint(self, path: str) -> dict[str, float]:
        """Collective: ``save_checkpoint``; this rank's time and peak memory."""
        started = time.perf_counter()
        with PeakMemory(self.device) as peak:
            self.save_checkpoint(path)
        return {"perf/checkpoint_s": time.perf_counter() - started,
                **phase_metrics("checkpoint", peak)}

    def export_with_receipt(self) -> tuple[None, dict[str, torch.Tensor] | None]:
        """Collective: (a receipt, rank 0's weights) as two Ray returns. The group waits on
        the small receipt (an error there says this rank died or failed) and hands the
        weights on by reference, never fetching them into the driver."""
        return None, self.export_weights()

    # Backend verbs.

    @abc.abstractmethod
    def setup(self, master_addr: str, master_port: int) -> None:
        """Collective: join the process group (``_join_process_group``), set this rank's
        layout (``dp_rank``, ``cp_rank``), build the role's model(s), the optimizer and
        its schedule."""

    @abc.abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Clip, step and zero the gradients and advance the schedule; returns
        ``grad_norm`` (before clipping) and the ``lr`` the step used."""

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


class BatchRank(TrainerRank):
    """A role that steps on rollouts (policy, value): a step is ``forward_backward`` of
    its own loss under the group's step plan, then ``optimizer_step``."""

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

    @abc.abstractmethod
    def forward_backward(self, batch: RolloutBatch, plan: StepPlan) -> dict[str, float]:
        """Collective: Σ w·ℓ of this role's loss over this rank's tokens of ``plan``,
        backpropagated and summed over DP×CP; returns the step's exact terms."""

    @abc.abstractmethod
    def _gradients(self, batch: RolloutBatch, plan: StepPlan, objective: ObjectiveConfig
                   ) -> tuple[dict[str, float], dict[str, torch.Tensor] | None]:
        """Collective, no update: one step's sums under ``objective`` and, on rank 0, the
        full summed fp64 gradient of every HF parameter; the gradients are cleared."""
