"""Attention tensors saved for the backward, per micro-batch, computed (not measured):
today's SDPA path (K/V expanded to every query head, ``repeat_kv``-style copies kept for
the backward) against FlexAttention (K/V at their kv heads, ``enable_gqa``), for three
public models at 4k and 16k tokens under padding, packing and shared prefix.

Per layer, bf16, T = tokens the forward computes:

    saved = T · D · (2·H_q  [Q, O]  +  2·H_kv'  [K, V]) · 2 B  +  T · H_q · 4 B  [LSE, fp32]

with H_kv' = H_q today and H_kv with FlexAttention; times the number of layers.
The workload: a micro-batch of B real tokens = one group of G = 8 samples sharing a
prompt of P = B/16 tokens, responses spread evenly over [R/2, 3R/2] (R = B/8 − P);
padding computes 8 × the longest sample, packing Σ L_i, a shared prefix Σ L_i − 7·P
(the prompt once; docs/attention.md explains the layouts).

    .venv/bin/python benchmarks/attention_memory.py
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


MODELS = (
    # From each model's public config.json (num_hidden_layers, num_attention_heads,
    # num_key_value_heads, hidden_size / num_attention_heads).
    Model("SmolLM2-135M", 30, 9, 3, 64),
    Model("Qwen2.5-0.5B", 24, 14, 2, 64),
    Model("Qwen2.5-7B", 28, 28, 4, 128),
)
GROUP_SIZE = 8
BF16, FP32 = 2, 4


def layout_tokens(budget: int) -> dict[str, int]:
    """Tokens the forward computes for one micro-batch of ``budget`` real tokens."""
    prompt = budget // 16
    mean_response = budget // GROUP_SIZE - prompt
    responses = [mean_response // 2 + (mean_response * i) // (GROUP_SIZE - 1)
                 for i in range(GROUP_SIZE)]  # R/2 … 3R/2, mean R
    lengths = [prompt + r for r in responses]
    return {"padding": GROUP_SIZE * max(lengths), "packing": sum(lengths),
            "shared prefix": sum(lengths) - (GROUP_SIZE - 1) * prompt}


def saved_bytes(model: Model, tokens: int, kv_heads: int) -> int:
    per_token = model.head_dim * (2 * model.num_heads + 2 * kv_heads) * BF16
    return model.num_layers * tokens * (per_token + model.num_heads * FP32)


def kv_bytes(model: Model, tokens: int, kv_heads: int) -> int:
    """The K and V part alone (what the expansion multiplies by H_q / H_kv)."""
    return model.num_layers * tokens * 2 * kv_heads * model.head_dim * BF16


def rows() -> list[tuple[str, int, str, int, float, float, float, float]]:
    out = []
    for model in MODELS:
        for budget in (4096, 16384):
            for layout, tokens in layout_tokens(budget).items():
                out.append((model.name, budget, layout, tokens,
                            kv_bytes(model, tokens, model.num_heads) / 1e9,
                            kv_bytes(model, tokens, model.num_kv_heads) / 1e9,
                            saved_bytes(model, tokens, model.num_heads) / 1e9,
                            saved_bytes(model, tokens, model.num_kv_heads) / 1e9))
    return out


def main() -> None:
    print("| model | micro-batch | layout | tokens computed | K/V today | K/V Flex "
          "| all saved today | all saved Flex |")
    print("|---|---|---|---|---|---|---|---|")
    for name, budget, layout, tokens, kv_today, kv_flex, today, flex in rows():
        print(f"| {name} | {budget // 1024}k | {layout} | {tokens} | {kv_today:.3f} GB "
              f"| {kv_flex:.3f} GB | {today:.3f} GB | {flex:.3f} GB ({flex / today:.0%}) |")


if __name__ == "__main__":
    main()
