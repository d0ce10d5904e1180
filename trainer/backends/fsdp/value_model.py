r"""The critic's model: ``AutoModelForTokenClassification`` with one label (a scalar value
per position) from a local Hugging Face folder.

From a causal LM's folder it is the decoder with a fresh value head ``score``,
initialised small as in Ziegler et al. (2019) and TRL's / OpenRLHF's value heads:

    W ~ Normal(0, std = 1 / (d + 1)),   b = 0          (d = hidden size)

so the first values are near 0 and the critic does not start with a large, arbitrary
error that its warm-up must first unlearn (Hugging Face's default is std 0.02 or
``initializer_range``, whatever d). A folder saved from a critic keeps its head.

Every dropout of the model's config is 0 (attention, hidden, classifier, …, in nested
configs too) and every ``nn.Dropout`` module's p is 0: a value is a function of the
weights, as the exact value loss and the verifier's layouts need.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from trainer.backends.fsdp.model import keep_norms_in_float64
from trainer.rank import master_dtype

HEAD = "score"
"""The token classifier's head module (Llama, Qwen2, Mistral, … name it so)."""


def dropouts_off(config: PretrainedConfig) -> list[str]:
    """Set every dropout probability of ``config`` (and its sub-configs) to 0: a key that
    names a dropout (``*dropout*``, GPT-2's ``*_pdrop``) holding a number. Returns the
    keys it set, dotted."""
    changed = []

    def visit(node: PretrainedConfig, prefix: str) -> None:
        for key, value in list(vars(node).items()):
            if isinstance(value, PretrainedConfig):
                visit(value, f"{prefix}{key}.")
            elif (("dropout" in key or key.endswith("_pdrop"))
                  and isinstance(value, (int, float)) and not isinstance(value, bool)):
                setattr(node, key, 0.0)
                changed.append(prefix + key)

    visit(config, "")
    config.classifier_dropout = 0.0  # read by the token classifier even when unset
    return changed


def init_value_head(head: torch.nn.Linear, generator: torch.Generator | None = None) -> None:
    """The module docstring's init: W ~ N(0, 1/(d + 1)), b = 0, d = ``in_features``."""
    with torch.no_grad():
        head.weight.normal_(mean=0.0, std=1.0 / (head.in_features + 1), generator=generator)
        if head.bias is not None:
            head.bias.zero_()


def load_value_model(model_path: str, compute_dtype: torch.dtype, device: torch.device
                     ) -> PreTrainedModel:
    """The critic of the module docstring in master-weight dtype on ``device``; a fresh
    head is drawn from the RNG seeded before (the same on every rank)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(model_path, num_labels=1)
    dropouts_off(config)
    loaded: Any = AutoModelForTokenClassification.from_pretrained(
        model_path, config=config, dtype=master_dtype(compute_dtype),
        output_loading_info=True)
    model, info = loaded
    head = getattr(model, HEAD)
    if any(key.startswith(f"{HEAD}.") for key in info["missing_keys"]):  # a fresh head
        init_value_head(head)
    for module in model.modules():  # a model that hard-codes its p rather than reading it
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.config.use_cache = False
    if compute_dtype == torch.float64:
        keep_norms_in_float64(model)
    return model.to(device)
