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

Attention is decided once, here (``megatron_attention``): TransformerEngine's layer spec
(context parallelism, packed THD rows) on GPU with TE installed and bf16 compute, else
megatron-core's local spec, which has neither. The driver decides (``decide_attention``:
the step plan packs or pads by it) and the ranks take that decision as given.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass

log = logging.getLogger("tally.trainer")

TRANSFORMER_ENGINE = "transformer-engine[pytorch]>=2.9,<2.12"
"""What megatron-core 0.16 runs with (its own dev extra's range)."""


@dataclass(frozen=True)
class MegatronAttention:
    """How every Megatron rank attends, decided once by the driver."""

    transformer_engine: bool
    """TransformerEngine's layer spec; False: megatron-core's local spec (no CP, no THD)."""
    packed: bool
    """Packed THD rows (``PackedSeqParams``); False: each micro-batch padded."""
    note: str = ""
    """Why ``trainer.packing: true`` (the default) is not honoured, for the log."""


def transformer_engine_available() -> bool:
    """TransformerEngine is installed: found, not imported (the controller checks a job
    without torch; a TE built against another torch fails when the ranks build)."""
    return importlib.util.find_spec("transformer_engine") is not None


def megatron_attention(config: object, te_available: bool, packing_explicit: bool = False
                       ) -> MegatronAttention:
    """The attention of ``config`` (a ``TrainerConfig``) given whether TransformerEngine
    is installed. TE's attention has no fp32/fp64 backend for CP or THD rows ("No dot
    product attention backend is available"), so TE is used in bf16 only. Raises
    ValueError naming the field for CP that cannot run, and for packing that cannot when
    ``packing_explicit`` (the user set it); the default ``packing: true`` falls back to
    padding with a ``note``."""
    gpu = config.num_gpus_per_rank > 0
    bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and gpu)
    use_te = gpu and te_available and bf16
    field = "trainer.dtype" if gpu and te_available else None
    missing = ("the ranks have no GPUs (num_gpus_per_rank: 0)" if not gpu
               else f"TransformerEngine is not installed ({TRANSFORMER_ENGINE}; the GPU "
                    f"image of deploy/ has none)" if not te_available
               else f"dtype {config.dtype} computes in fp32 or fp64, where TransformerEngine "
                    f"has no attention backend for them; set dtype: bfloat16 (or auto)")
    if config.cp_size > 1 and not use_te:
        raise ValueError(f"{field or 'trainer.cp_size'}: context parallelism with "
                         f"backend=megatron needs GPUs, TransformerEngine and bf16 compute: "
                         f"{missing}")
    if config.packing and not use_te:
        if packing_explicit:
            raise ValueError(f"{field or 'trainer.packing'}: packing: true with "
                             f"backend=megatron needs TransformerEngine's THD rows (GPUs, "
                             f"TransformerEngine, bf16): {missing}; or set packing: false "
                             f"to pad micro-batches")
        return MegatronAttention(use_te, False, "trainer.packing: backend=megatron pads "
                                                f"micro-batches instead of packing: {missing}")
    return MegatronAttention(use_te, bool(config.packing))


def decide_attention(config: object) -> MegatronAttention:
    """The driver's decision for ``config`` with this process's TransformerEngine; says
    once when the default packing falls back to padding (a warning on GPU ranks; on CPU,
    where Megatron always pads, a quiet note)."""
    attention = megatron_attention(config, transformer_engine_available())
    if attention.note:
        _log_once(attention.note, logging.WARNING if config.num_gpus_per_rank > 0
                  else logging.INFO)
    return attention


@functools.cache
def _log_once(note: str, level: int) -> None:
    log.log(level, note)


def check_available(config: object, model_path: str | None = None) -> None:
    """Preflight for ``trainer.backend: megatron`` (what pydantic cannot see): the extra is
    installed, CP and an explicit ``packing: true`` have what they need
    (``megatron_attention``), and the model is one the backend converts at this TP size.
    ``config`` is a ``TrainerConfig``; raises ValueError naming the field."""
    if importlib.util.find_spec("megatron") is None or \
            importlib.util.find_spec("megatron.core") is None:
        raise ValueError("trainer.backend: megatron needs megatron-core; install the extra "
                         "with pip install '.[megatron]'")
    megatron_attention(config, transformer_engine_available(),
                       packing_explicit="packing" in config.model_fields_set)
    if model_path is not None:
        from transformers import AutoConfig

        from trainer.backends.megatron.model import model_shape

        try:
            model_shape(AutoConfig.from_pretrained(model_path), config.tp_size)
        except (ValueError, NotImplementedError) as err:
            raise ValueError(f"trainer.backend: megatron cannot train {model_path}: "
                             f"{err}") from None
