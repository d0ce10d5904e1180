"""Random-initialised reward-model folders for tests: an ``AutoModelForSequenceClassification``
with one label, saved with a tokenizer (the tiny policy's, or another with a chat
template)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer


def save_random_reward_model(path: Path, tokenizer_path: str, seed: int = 0,
                             num_labels: int = 1) -> str:
    """A small Qwen2 sequence classifier over ``tokenizer_path``'s vocabulary, random
    weights (seeded), its tokenizer beside it; its pad token is the tokenizer's."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, num_labels=num_labels,
                         pad_token_id=pad)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)  # scores that differ visibly
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)
