"""The embedded default model: a tiny random-init Qwen2 with the character tokenizer.

Small enough to sample and train on a laptop CPU in seconds, yet a real transformers
``Qwen2ForCausalLM`` saved with ``save_pretrained`` (safetensors), so every code path
(from_pretrained, state dicts, SGLang's loader) is the one a real model takes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from rollout.tokenizer import build_char_tokenizer

TINY_MODEL_NAME = "tiny"
TINY_ARCHITECTURE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def create_tiny_checkpoint(path: str | Path, seed: int = 0) -> str:
    """Write the tiny model and its tokenizer to `path`; same seed, same weights."""
    path = Path(path)
    # Imported here: resolving an already built model (every job start) needs none of it.
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **TINY_ARCHITECTURE,
    )
    # Seed a forked RNG so creating a checkpoint leaves the caller's RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def default_cache_dir() -> Path:
    """Where `tiny` checkpoints are cached unless the caller says otherwise."""
    return Path(os.environ.get("TALLY_CACHE_DIR", Path.home() / ".cache" / "tally"))


def resolve_model_path(model: str, cache_dir: str | Path | None = None, seed: int = 0) -> str:
    """`tiny` → a cached tiny checkpoint directory (created once); a local path → itself.

    Nothing is ever downloaded: anything else must be an existing local directory.
    """
    if model == TINY_MODEL_NAME:
        target = Path(cache_dir or default_cache_dir()) / f"tiny-seed{seed}"
        if not (target / "config.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            # Build beside the target, then rename: concurrent resolvers never see a
            # half-written checkpoint, and the loser of the race just drops its copy.
            staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
            create_tiny_checkpoint(staging, seed=seed)
            try:
                staging.rename(target)
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
        return str(target)
    from rollout.pretrained import resolve_pretrained

    imported = resolve_pretrained(model, Path(cache_dir or default_cache_dir()))
    if imported is not None:
        return imported
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model: {model!r} is neither 'tiny', 'smollm2-135m-instruct' nor an existing "
            "local directory "
            f"(models are never downloaded)"
        )
    return str(path)
