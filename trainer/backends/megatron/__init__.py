"""Megatron-core trainer backend (``trainer.backend: megatron``; ``pip install .[megatron]``).

    model.py       GPTModel + TransformerConfig from a Hugging Face Qwen2 / Llama config
    convert.py     HF <-> Megatron weights at any TP size (pure, exact)
    weights.py     moving whole HF state dicts in and out of the sharded model (collective)
    loss.py        Megatron's loss contract around trainer/objective.py: vocab-parallel
                   log-probs and entropy of softmax(z / T), THE SUM factor
    main_params.py fp32 main params under bf16 compute, DP×CP gradient mean, clipping
    cpu_bridge.py  megatron-core's CUDA assumptions, bridged on CPU only
    worker.py      MegatronWorker, the rank actor (same verbs as FSDPWorker)
    checkpoint.py  checkpoints in the torch backend's format

No module here imports megatron-core at import time (only inside functions), so the
package loads without the extra; ``check_available`` is the preflight a driver runs.
"""

from __future__ import annotations

import importlib.util


def check_available(config: object, model_path: str | None = None) -> None:
    """Preflight for ``trainer.backend: megatron`` (what pydantic cannot see): the extra is
    installed, CP has what it needs, and the model is one the backend converts at this TP
    size. ``config`` is a ``TrainerConfig``; raises ValueError naming the field."""
    if importlib.util.find_spec("megatron") is None or \
            importlib.util.find_spec("megatron.core") is None:
        raise ValueError("trainer.backend: megatron needs megatron-core; install the extra "
                         "with pip install '.[megatron]'")
    if config.cp_size > 1 and (config.num_gpus_per_rank == 0
                               or importlib.util.find_spec("transformer_engine") is None):
        raise ValueError("trainer.cp_size: context parallelism with backend=megatron needs "
                         "GPUs (num_gpus_per_rank > 0) and TransformerEngine")
    if model_path is not None:
        from transformers import AutoConfig

        from trainer.backends.megatron.model import model_shape

        try:
            model_shape(AutoConfig.from_pretrained(model_path), config.tp_size)
        except (ValueError, NotImplementedError) as err:
            raise ValueError(f"trainer.backend: megatron cannot train {model_path}: "
                             f"{err}") from None
