"""Shared by the Megatron tests: a trainer rank in a plain gloo process
(``tests.distributed.run_ranks``, no Ray; the worker joins the process group through its
own ``setup``), the default objective, how far apart two state dicts are, and the tiny
model with a vocabulary that spans every TP rank the TP tests use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.config import AggregationConfig, ObjectiveConfig, TrainerConfig

MAX_RESPONSE_LEN = 10
WIDE_VOCAB = 200
"""The vocabulary of the TP tests' tiny model: Megatron pads the vocabulary to a multiple
of 128·TP and gives each TP rank an equal slice, so at TP=2 rank 1 holds ids 128..255 —
all padding with the char tokenizer's 100 ids, real ids 128..199 here. Batches drawn
over the whole vocabulary (``random_train_batch(WIDE_VOCAB)``) put targets on both."""



def create_wide_vocab_checkpoint(path: str | Path, seed: int = 0) -> str:
    """The tiny model (``rollout.tiny``'s architecture and char tokenizer) with a
    ``WIDE_VOCAB``-row embedding and head; ids past the tokenizer's are never decoded."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from rollout.tiny import TINY_ARCHITECTURE
    from rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    assert len(tokenizer) < WIDE_VOCAB
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=WIDE_VOCAB, **ids, **TINY_ARCHITECTURE))
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def objective_for(config: TrainerConfig, temperature: float = 1.0) -> ObjectiveConfig:
    """The default (sample_mean) objective of ``config`` at ``temperature``."""
    return ObjectiveConfig.compose(AggregationConfig(), config.loss, MAX_RESPONSE_LEN,
                                   temperature)


def start_worker(config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 rank: int, port: int, total_steps: int = 4) -> Any:
    """A set-up Megatron rank (once per process, on every rank at the same time)."""
    from trainer.backends.megatron.worker import MegatronWorker

    worker = MegatronWorker(config, objective, model_path, rank, total_steps)
    worker.setup("127.0.0.1", port)
    return worker


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ‖a − b‖∞ / max(‖b‖∞, tiny)."""
    return max(float((a[k].double() - b[k].double()).abs().max()
                     / b[k].double().abs().max().clamp(min=1e-30)) for k in b)
