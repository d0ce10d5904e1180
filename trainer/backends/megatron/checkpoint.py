"""Megatron trainer checkpoints in the torch backend's format, independent of TP size.

The model is written as a Hugging Face folder (``trainer.checkpoint``) of the fp32 main
params (never the compute-dtype copy the model runs, ``main_params.py``); the optimizer
state is written like torch's full optimizer state dict — ``{"state": {hf_name: {...}},
"param_groups": [...]}`` — with every parameter-shaped moment (AdamW's ``exp_avg``,
``exp_avg_sq``) converted to HF names and shapes by the same rules as the weights. A
checkpoint can be resumed under another TP size. Megatron's RNG-tracker streams are not
saved: the backend runs without dropout.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainer.checkpoint import (
    load_trainer_checkpoint,
    restore_schedule_and_rng,
    save_trainer_checkpoint,
    trainer_state,
)

if TYPE_CHECKING:
    from trainer.backends.megatron.worker import MegatronWorker


def _moment_keys(worker: MegatronWorker) -> list[str]:
    """Optimizer state entries shaped like their parameter (sorted: same on every rank)."""
    keys = set()
    for p in worker.params:
        for key, value in worker.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                keys.add(key)
    return sorted(keys)


def export_optimizer_state(worker: MegatronWorker) -> dict | None:
    """Collective; rank 0 gets the full HF-named optimizer state dict, others None."""
    by_param = {name: worker.optimizer.state.get(p, {})
                for name, p in worker.weights.params.items()}
    moments = {key: worker.weights.gather({n: s[key] for n, s in by_param.items() if key in s})
               for key in _moment_keys(worker)}
    if worker.rank != 0:
        return None
    hf_names = [n for rule in worker.weights.rules for n in rule.hf]
    scalars = {k: v for s in by_param.values() for k, v in s.items()
               if k not in moments and v is not None}  # e.g. AdamW's step, equal for all
    state = {name: {**{k: v.clone() if isinstance(v, torch.Tensor) else v  # never shared:
                       for k, v in scalars.items()},  # optimizers update `step` in place
                    **{k: m[name] for k, m in moments.items() if name in m}}
             for name in hf_names} if (moments or scalars) else {}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": hf_names}
              for g in worker.optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_optimizer_state(worker: MegatronWorker, saved: dict | None) -> None:
    """Collective; rank 0 passes the saved optimizer state dict."""
    state = (saved or {}).get("state", {})
    first = next(iter(state.values()), {})
    meta = [{
        "moments": sorted(k for k, v in first.items() if isinstance(v, torch.Tensor) and v.ndim),
        "scalars": {k: v for k, v in first.items()
                    if not (isinstance(v, torch.Tensor) and v.ndim)},
        "hyper": {k: v for k, v in (saved or {}).get("param_groups", [{}])[0].items()
                  if k != "params"},
    }]
    dist.broadcast_object_list(meta, src=0)
    moments, scalars, hyper = meta[0]["moments"], meta[0]["scalars"], meta[0]["hyper"]
    worker.optimizer.state.clear()
    for key in moments:
        hf = {name: s[key] for name, s in state.items() if key in s} if worker.rank == 0 else None
        for rule, tensor in worker.weights.scatter(hf):
            param = worker.weights.params[rule.megatron]
            worker.optimizer.state[param][key] = tensor.to(param.dtype).clone()
    for p in worker.params:
        for key, value in scalars.items():
            worker.optimizer.state[p][key] = (value.clone() if isinstance(value, torch.Tensor)
                                              else value)
    for group in worker.optimizer.param_groups:
        group.update(hyper)


def save(worker: MegatronWorker, path: str) -> None:
    model_state = worker.weights.export()
    optim = export_optimizer_state(worker)
    if worker.rank == 0:
        save_trainer_checkpoint(path, worker.model_path, SimpleNamespace(config=worker.hf_config),
                                model_state, trainer_state(optim, worker.scheduler))
    dist.barrier()


def load(worker: MegatronWorker, path: str) -> None:
    model_state, saved = load_trainer_checkpoint(path) if worker.rank == 0 else ({}, {})
    worker.load_weights(model_state if worker.rank == 0 else None)  # main params + model
    load_optimizer_state(worker, saved.get("optimizer"))
    restore_schedule_and_rng(saved, worker.scheduler)
