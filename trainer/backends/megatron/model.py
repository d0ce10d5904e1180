"""A megatron-core ``GPTModel`` equivalent to a Hugging Face Qwen2 / Llama causal LM.

Both families are pre-norm decoders with RoPE (rotate-half), RMSNorm, a SwiGLU MLP and
grouped-query attention; Qwen2 adds a bias to q/k/v. Their Megatron spelling:

    HF                                      TransformerConfig / GPTModel
    hidden_size, intermediate_size          hidden_size, ffn_hidden_size
    num_attention_heads, num_key_value_heads num_attention_heads, num_query_groups
    head_dim (or hidden / heads)            kv_channels
    rms_norm_eps                            normalization="RMSNorm", layernorm_epsilon
    hidden_act="silu"                       gated_linear_unit=True, activation_func=silu
    q/k/v bias (Qwen2)                      add_qkv_bias=True (add_bias_linear=False)
    rope_theta, rope llama3 scaling         rotary_base, rope_scaling(_factor)
    tie_word_embeddings                     share_embeddings_and_output_weights

The vocabulary is padded to a multiple of 128·TP (Megatron's make-vocab-size-divisible-by)
so it splits evenly over TP ranks; the loss masks the padded logits. The model keeps its
logits vocab-parallel (``parallel_output=True``). The TE layer spec (it carries
context-parallel and THD attention) is used where the driver's attention decision says so
(``backends.megatron.megatron_attention``: GPU, TransformerEngine, bf16); else the local
spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
VOCAB_DIVISIBLE_BY = 128


@dataclass(frozen=True)
class ModelShape:
    """What weight conversion and the loss need to know about the model."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    tp_size: int

    @property
    def vocab_per_rank(self) -> int:
        return self.padded_vocab_size // self.tp_size


def _rope(hf_config: object) -> tuple[float, float | None]:
    """(rotary_base, llama3 scaling factor or None); other scalings are refused."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    megatron_llama3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
    if rope_type == "llama3" and all(
            float(params.get(k, v)) == v for k, v in megatron_llama3.items()):
        return theta, float(params["factor"])
    raise NotImplementedError(f"rope_parameters: {params} has no megatron-core equivalent here")


def model_shape(hf_config: object, tp_size: int) -> ModelShape:
    """Check the HF config is one this backend reproduces exactly, and describe it."""
    cfg = hf_config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"model_type: {cfg.model_type!r}; the Megatron backend "
                                  f"converts {SUPPORTED_MODEL_TYPES}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act: {cfg.hidden_act!r}, expected silu (SwiGLU)")
    if getattr(cfg, "use_sliding_window", False):
        raise NotImplementedError("use_sliding_window: sliding-window attention is not mapped")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise NotImplementedError("attention_bias/mlp_bias: biases on o_proj/MLP are not mapped")
    num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
    if num_kv_heads % tp_size or cfg.num_attention_heads % tp_size:
        raise ValueError(f"tp_size: {tp_size} must divide num_attention_heads "
                         f"({cfg.num_attention_heads}) and num_key_value_heads "
                         f"({num_kv_heads}): each TP rank holds whole query groups")
    _rope(cfg)
    multiple = VOCAB_DIVISIBLE_BY * tp_size
    return ModelShape(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=-(-cfg.vocab_size // multiple) * multiple,
        tied_embeddings=bool(cfg.tie_word_embeddings),
        qkv_bias=cfg.model_type == "qwen2",
        tp_size=tp_size,
    )


def build_gpt_model(hf_config: object, shape: ModelShape, cp_size: int, dtype: torch.dtype,
                    device: torch.device, *, transformer_engine: bool = False
                    ) -> torch.nn.Module:
    """An uninitialised GPTModel for this rank (weights come from ``convert``), with
    TransformerEngine's layer spec when ``transformer_engine`` (the driver's decision,
    ``MegatronAttention.transformer_engine``), else megatron-core's local spec.

    Call inside ``cpu_bridge`` after ``parallel_state.initialize_model_parallel``.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer import TransformerConfig

    if transformer_engine and device.type != "cuda":
        raise NotImplementedError(f"TransformerEngine's layer spec runs on CUDA, and this "
                                  f"rank's device is {device}")
    if cp_size > 1 and not transformer_engine:
        raise NotImplementedError(
            "cp_size: context parallelism in the Megatron backend needs TransformerEngine "
            "attention on GPU; megatron-core's local attention has no CP")
    rotary_base, rope_scaling_factor = _rope(hf_config)
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=shape.tp_size,
        context_parallel_size=cp_size,
        sequence_parallel=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        cp_comm_type="p2p" if cp_size > 1 else None,
    )
    layer_spec = (specs.get_gpt_layer_with_transformer_engine_spec()
                  if transformer_engine
                  else specs.get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        rope_scaling=rope_scaling_factor is not None,
        rope_scaling_factor=rope_scaling_factor or 8.0,
    )
    # Megatron's local spec builds its norms with torch's default dtype; on GPU its
    # Float16Module would cast them. Here every parameter is the compute dtype, and the
    # fp32 main copies live in main_params.py.
    return model.to(device=device, dtype=dtype)
