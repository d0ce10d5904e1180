"""Warm start: a short supervised pass on the synthetic task before RL.

From a random init an exact-match reward is essentially never hit, so every group ties
at 0 and no policy gradient flows. A few hundred supervised steps (seconds on CPU) leave
the tiny model well below perfect, and RL takes it from there. The result is cached in
the data folder under a hash of everything that determines it; jobs that start at once
with the same warm start compute it once (the first holds a file lock on it, the others
wait and read the cache).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rollout.config import SyntheticDatasetConfig
from rollout.tasks import iter_task_examples
from rollout.tokenizer import encode_completion, encode_prompt, load_tokenizer
from services.config.job import WarmupConfig


def _cache_key(model_path: str, dataset: SyntheticDatasetConfig, config: WarmupConfig) -> str:
    weights = Path(model_path) / "model.safetensors"
    fingerprint = {
        "model": hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists()
        else model_path,
        "task": dataset.task, "difficulty": dataset.difficulty, **config.model_dump(),
    }
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def warm_start(model_path: str, dataset: SyntheticDatasetConfig, config: WarmupConfig,
               cache_dir: Path, log=print) -> str:
    """Path of the warmed-up model (trained now, or found in the cache)."""
    target = cache_dir / f"warmup-{dataset.task}-{_cache_key(model_path, dataset, config)}"
    if (target / "config.json").exists():
        log(f"warmup: cached at {target}")
        return str(target)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / "config.json").exists():
            log(f"warmup: cached at {target} (by a job that started with this one)")
            return str(target)
        return _train_warm_start(model_path, dataset, config, cache_dir, target, log)


def _train_warm_start(model_path: str, dataset: SyntheticDatasetConfig, config: WarmupConfig,
                      cache_dir: Path, target: Path, log) -> str:
    tokenizer = load_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    examples = iter_task_examples(dataset.task, dataset.difficulty, seed=config.seed + 10_007)
    torch.manual_seed(config.seed)
    model.train()
    for step in range(config.num_steps):
        batch = [next(examples) for _ in range(config.batch_size)]
        loss = _supervised_loss(model, tokenizer, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == config.num_steps - 1:
            log(f"warmup: step {step + 1}/{config.num_steps} loss {loss.item():.3f}")
    staging = Path(tempfile.mkdtemp(prefix=".warmup-", dir=cache_dir))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another job cached the same warm start first
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _supervised_loss(model: torch.nn.Module, tokenizer, batch: list) -> torch.Tensor:
    """Mean next-token cross-entropy over answer tokens (and EOS)."""
    sequences, answer_masks = [], []
    for example in batch:
        prompt = encode_prompt(tokenizer, example.prompt)
        answer = encode_completion(tokenizer, example.answer)
        sequences.append(prompt + answer)
        answer_masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(len(s) for s in sequences)
    ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(batch), width)
    for i, (seq, m) in enumerate(zip(sequences, answer_masks, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    logits = model(input_ids=ids).logits[:, :-1]
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    target_mask = mask[:, 1:].reshape(-1)
    return (losses * target_mask).sum() / target_mask.sum()
