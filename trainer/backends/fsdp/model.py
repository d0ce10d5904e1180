"""torch FSDP2 backend: load a Hugging Face causal LM, shard it, move its state.

Precision: parameters (and so AdamW's state) are fp32 master weights; FSDP2's
``MixedPrecisionPolicy`` casts them to the compute dtype for each forward/backward and
reduces gradients in fp32 (``param_dtype=compute, reduce_dtype=fp32``). A step of
lr 1e-6 therefore changes a weight near 0.02 even though bf16 could not represent it.

Parameters are sharded with ``fully_shard`` over every DP × CP rank (as torchtitan does
with its dp_shard × cp mesh), so one reduce-scatter sums gradients over DP and CP (one
rank computing in its master dtype is left unwrapped: :func:`shard_model`). FSDP
divides that sum by the world size; the trainer scales its local loss by
``aggregation.sum_reduction_factor(world_size)`` to get the plain SUM back.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer.config import TrainerConfig
from trainer.lora import decoder_layers
from trainer.rank import compute_dtype as configured_dtype
from trainer.rank import master_dtype

log = logging.getLogger("tally.trainer")

FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def load_model(model_path: str, compute_dtype: torch.dtype, device: torch.device
               ) -> PreTrainedModel:
    """A causal LM from a local Hugging Face folder (safetensors), master-weight dtype."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=master_dtype(compute_dtype))
    model.config.use_cache = False
    if compute_dtype == torch.float64:
        keep_norms_in_float64(model)
    return model.to(device)


def keep_norms_in_float64(model: torch.nn.Module) -> int:
    """Let Hugging Face's RMSNorms (Llama, Qwen, Mistral: ``weight · x/√(mean x² + ε)``
    with ``variance_epsilon``) compute in float64 instead of their fp32 upcast, which
    rounds a float64 input to fp32. The forward is the same either way per token, but a
    backward that sums gradients before that rounding (a shared prefix sums its G
    responses') then differs from one that sums after it by fp32 rounding, ~1e-7 — more
    than the verifier's float64 tolerance. Returns how many norms it changed."""
    import types

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    changed = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(forward, module)
            changed += 1
    return changed


class AttentionChoice(NamedTuple):
    """The attention kernel of a model's rows and why (what the rank logs)."""

    implementation: str
    """``flash_attention_2`` (varlen, samples found from position ids), ``flex_attention``
    (FlexAttention under the row layout's BlockMask: ``trainer/attention_flex.py``),
    ``sdpa`` (the layout's SDPA kernels of ``trainer/cp_attention.py``) or ``model``
    (padded rows at cp 1: the model's own attention)."""
    reason: str


FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""The only dtypes flash-attention 2 computes in (fp32 and the verifier's fp64 raise)."""
FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""What FlexAttention's CUDA kernels compute in (not the verifier's float64)."""


def attention_choice(*, device_type: str, dtype: torch.dtype, packed: bool = True,
                     shared_prefix: bool = False, cp_size: int = 1,
                     flash_attn_2_available: bool = False) -> AttentionChoice:
    """The kernel for a job's rows, decided once per model from what the rank has:

    - padded rows at cp 1: the model's own attention (nothing is packed);
    - CP > 1: SDPA under the layout's mask over all-gathered K/V (FlexAttention here has
      no CP);
    - CPU: the SDPA pieces (FlexAttention has no backward on CPU in torch 2.13, and its
      eager forward measured slower: docs/attention.md);
    - CUDA in float64: SDPA (FlexAttention's kernels take fp16/bf16/fp32);
    - CUDA, nothing shared, fp16/bf16 and flash-attention 2 installed (as transformers
      sees it): varlen flash attention;
    - CUDA otherwise (a shared prefix, fp32, no flash-attention 2): FlexAttention."""
    if not packed and cp_size == 1:
        return AttentionChoice("model", "padded rows, cp_size 1: the model's own attention")
    if cp_size > 1:
        return AttentionChoice("sdpa", f"cp_size {cp_size}: SDPA over all-gathered K/V")
    if device_type != "cuda":
        return AttentionChoice("sdpa", f"device is {device_type}, not cuda: SDPA pieces "
                                       f"(FlexAttention has no backward there)")
    if dtype not in FLEX_DTYPES:
        return AttentionChoice("sdpa", f"compute dtype {dtype} (FlexAttention and "
                                       f"flash-attention 2 take fp16/bf16/fp32 only)")
    if not shared_prefix and dtype in FLASH_DTYPES and flash_attn_2_available:
        return AttentionChoice("flash_attention_2",
                               f"cuda, {dtype}, no shared prefix, flash-attention 2 installed")
    why = ("a shared prefix (varlen flash cannot read a head's prompt)" if shared_prefix
           else "fp32 (flash-attention 2 takes fp16/bf16)" if dtype not in FLASH_DTYPES
           else "transformers finds no flash-attention 2 (the flash-attn package, >= 2.3.3)")
    return AttentionChoice("flex_attention", f"cuda, {dtype}, {why}")


@functools.cache
def _log_choice(choice: AttentionChoice) -> None:
    """Once per process and choice (the policy and the reference model ask alike)."""
    log.info("trainer.attention implementation=%s reason=%r", *choice,
             extra={"attention_implementation": choice.implementation,
                    "attention_reason": choice.reason})


def configure_attention(model: PreTrainedModel, config: TrainerConfig,
                        dtype: torch.dtype | None = None) -> AttentionChoice:
    """Switch the model to :func:`attention_choice`'s kernel and log it (once per rank).

    ``dtype``: the compute dtype (None: ``trainer.dtype`` on the model's device). The
    flash package is judged by transformers' own check, never by ``import flash_attn``:
    flash-attn-4 alone also provides that module, and transformers would then try to
    fetch a kernel from the Hub (impossible under HF_HUB_OFFLINE=1). Varlen flash
    attention finds each sample from position ids that restart at 0."""
    from transformers.utils import is_flash_attn_2_available

    device = next(model.parameters()).device
    choice = attention_choice(device_type=device.type,
                              dtype=dtype or configured_dtype(config, device),
                              packed=config.packing, shared_prefix=config.shares_prefix,
                              cp_size=config.cp_size,
                              flash_attn_2_available=is_flash_attn_2_available())
    _log_choice(choice)
    if choice.implementation == "flash_attention_2":
        model.set_attn_implementation("flash_attention_2")
    elif choice.implementation in ("sdpa", "flex_attention"):
        from trainer.cp_attention import enable_context_parallel

        enable_context_parallel(model, choice.implementation)  # masked by the row layout
    return choice


def shard_model(model: PreTrainedModel, compute_dtype: torch.dtype, world_size: int
                ) -> PreTrainedModel:
    """FSDP2: one shard group per decoder layer, then the root (embeddings, head), each
    casting its fp32 parameters to ``compute_dtype`` and reducing gradients in fp32.

    One rank computing in its master dtype is left unwrapped: FSDP would only copy each
    layer's parameters into its all-gather buffer and its gradients out of the
    reduce-scatter (the tiny model's train step: 0.055 s wrapped, 0.043 s not; SmolLM2's
    1.4% of 11 s). Everything downstream takes plain tensors as well as DTensors."""
    casts = compute_dtype != master_dtype(compute_dtype)
    if world_size == 1 and not casts:
        return model
    policy = (MixedPrecisionPolicy(param_dtype=compute_dtype,
                                   reduce_dtype=master_dtype(compute_dtype))
              if casts else MixedPrecisionPolicy())  # fp32 throughout: nothing to cast
    for layer in decoder_layers(model):  # a LoRA model's too: adapters shard with them
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def export_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank must call it and gets the whole unsharded state dict on CPU,
    in the master-weight dtype (fp32: checkpoints and engines never see rounded weights).

    Without mixed precision, unsharding each FSDP group gathers its parameters in one
    batched all-gather, several times faster than per-tensor gathers or DCP's
    ``get_model_state_dict`` (about 10 ms instead of 50-80 ms for the tiny model). With
    a lower compute dtype FSDP would unshard in that dtype, so each fp32 shard is
    gathered on its own instead.
    """
    saved_names = set(model.state_dict())  # persistent buffers only, like state_dict
    owned = dict(model.named_parameters(remove_duplicate=False)) | {
        name: b for name, b in model.named_buffers() if name in saved_names}
    return {name: tensor.to("cpu", copy=True) for name, tensor in full_tensors(model, owned)}


def _casts_params(group: FSDPModule) -> bool:
    """True when the group computes in a dtype other than its parameters'."""
    policy = group._get_fsdp_state()._mp_policy  # FSDP2 keeps no public getter
    return policy.param_dtype is not None


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Collective: rank 0 passes the whole state dict, the others an empty one."""
    set_model_state_dict(model, state_dict, options=FROM_RANK0)


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict) -> None:
    """Collective: rank 0 passes a full (HF-named) optimizer state, the others {}."""
    set_optimizer_state_dict(model, optimizer, state, options=FROM_RANK0)


def init_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh AdamW the state its first step would create (step 0, zero moments,
    each sharded like its parameter), so a checkpoint has tensors to load into. torch's
    own way (``_init_optim_state``: a step on zero gradients) holds a gradient for every
    parameter meanwhile: 4 more bytes per parameter at the peak of a resume."""
    if optimizer.state or not isinstance(optimizer, torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            state["step"] = torch.zeros((), dtype=torch.float32)  # AdamW's, uncaptured
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p)


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  trainable_only: bool = False) -> dict[str, dict]:
    """This rank's shards (DTensors) of the weights and the AdamW state, as DCP saves and
    loads them: nothing is gathered. (An optimizer without state yet gets it first, so a
    fresh rank has every tensor a checkpoint holds to load into.) ``trainable_only``:
    the trained weights alone (LoRA's adapters; the frozen base is the model folder's)."""
    init_adamw_state(optimizer)
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    weights = get_model_state_dict(model, options=options)
    if trainable_only:  # a head tied to the frozen embedding still shows up: drop it
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        weights = {name: value for name, value in weights.items() if name in trained}
    return {"model": weights,
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}


def set_sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      state: dict[str, dict], trainable_only: bool = False) -> None:
    # strict=False under trainable_only: the frozen base is absent on purpose; DCP has
    # already refused a checkpoint that lacks one of the trained tensors.
    options = StateDictOptions(ignore_frozen_params=trainable_only,
                               strict=not trainable_only)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def weight_shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """The HF names and full shapes of what an engine loads, in a fixed order: each
    parameter once (a tied head is its embedding's alias), then persistent buffers."""
    saved = set(model.state_dict())
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    shapes += [(name, tuple(b.shape)) for name, b in model.named_buffers() if name in saved]
    return shapes


def full_tensors(model: torch.nn.Module, owned: dict[str, torch.Tensor]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: each tensor of ``owned`` (name → parameter or buffer) unsharded, in
    order; each valid until the generator is exhausted. Without mixed precision every FSDP
    group is unsharded by one batched all-gather (as :func:`export_full_state_dict`; the
    tiny model at DP 2: 3 collectives instead of 26), so a rank briefly holds the whole
    model; else each tensor is gathered on its own."""
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not groups or any(_casts_params(group) for group in groups):
        for name in owned:
            yield name, full_tensor(owned, name)
        return
    for group in groups:
        group.unshard()
    try:
        unsharded = (dict(model.named_parameters(remove_duplicate=False))
                     | dict(model.named_buffers()))
        for name in owned:
            yield name, unsharded[name].detach()
    finally:
        for group in groups:
            group.reshard()


def full_tensor(owned: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Collective: one weight unsharded, in its master dtype (one all-gather of a
    DTensor; every rank gets it). ``owned``: the model's parameters and buffers by name."""
    return unsharded(owned[name])


def unsharded(tensor: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor: the whole of a parameter or buffer (a plain tensor is
    already whole), detached."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
