"""The trainer group: one Ray actor per DP × CP rank, driven in lock step.

The group makes the step plan (aggregation weights from whole-step metadata, micro-batch
assignment) once, ships it through the object store, and calls the same verb on every
rank. Actors sit in a placement group: one bundle per rank, packed on one node unless
the cluster cannot hold them (``STRICT_PACK`` by default).
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout.batch import TrainBatch
from trainer.config import LossConfig, TrainerConfig
from trainer.step_plan import plan_step
from trainer.worker import TrainerWorker


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def worker_class(backend: str) -> type:
    """The rank actor of a backend; every backend exposes the same verbs."""
    if backend == "fsdp":
        return TrainerWorker
    if backend == "megatron":
        from trainer.backends.megatron.worker import MegatronWorker

        return MegatronWorker
    raise ValueError(f"trainer.backend: unknown backend {backend!r}")


class TrainerGroup:
    def __init__(self, config: TrainerConfig, model_path: str, total_steps: int,
                 max_response_len: int | None = None, strategy: str = "STRICT_PACK",
                 env_vars: dict[str, str] | None = None) -> None:
        self.config, self.max_response_len = config, max_response_len
        bundle = {"CPU": config.num_cpus_per_rank}
        if config.num_gpus_per_rank:
            bundle["GPU"] = config.num_gpus_per_rank
        self.placement_group: PlacementGroup = placement_group(
            [dict(bundle) for _ in range(config.world_size)], strategy=strategy)
        ray.get(self.placement_group.ready())
        actor_cls = ray.remote(worker_class(config.backend))
        self.workers = [
            actor_cls.options(
                num_cpus=config.num_cpus_per_rank,
                num_gpus=config.num_gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env_vars or {}},
            ).remote(config, model_path, rank, total_steps, max_response_len)
            for rank in range(config.world_size)
        ]
        master_addr, master_port = ray.get(self.workers[0].node_address.remote())
        self._call("setup", master_addr, master_port)

    def _call(self, verb: str, *args: Any) -> list[Any]:
        """Run ``verb`` on every rank at once and wait for all of them."""
        return ray.get([getattr(w, verb).remote(*args) for w in self.workers])

    def train(self, batch: TrainBatch | ray.ObjectRef,
              loss: LossConfig | None = None) -> dict[str, float]:
        """One optimizer step on a whole rollout batch; returns the step's exact metrics.

        ``loss`` overrides the configured loss terms' aggregation for this step only.
        """
        batch_ref = batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)
        batch = ray.get(batch_ref) if isinstance(batch, ray.ObjectRef) else batch
        plan = plan_step(batch, loss or self.config.loss, self.config.dp_size,
                         self.config.cp_size, self.config.max_tokens_per_micro_batch,
                         self.max_response_len)
        return self._call("train_step", batch_ref, ray.put(plan))[0]

    def async_export_weights(self) -> ray.ObjectRef:
        """Gather the full weights (collective); the ref holds rank 0's state dict."""
        refs = [w.export_weights.remote() for w in self.workers]
        ray.wait(refs, num_returns=len(refs))
        return refs[0]

    def load_weights(self, state_dict: dict | ray.ObjectRef) -> None:
        """Replace the policy weights on every rank (rank 0's copy is broadcast)."""
        ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(state_dict)
        ray.get([w.load_weights.remote(ref if rank == 0 else None)
                 for rank, w in enumerate(self.workers)])

    def save_checkpoint(self, path: str) -> None:
        self._call("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._call("load_checkpoint", path)

    def worker_locations(self) -> list[str]:
        return ray.get([w.node_address.remote() for w in self.workers])

    def shutdown(self) -> None:
        with contextlib.suppress(ray.exceptions.RayError):  # a dead rank has nothing to do
            self._call("shutdown")
        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self.placement_group)
