"""Reward-model actors: a Hugging Face ``AutoModelForSequenceClassification`` with one
label scoring (prompt, response) texts (``rollout.reward`` part of ``type: model``).

    texts (rollout/reward_text.py) ─► RM tokenizer ─► right-padded batches ─► logits[:, 0]
                                       (the last max_length tokens)   at the last non-pad token

The score is transformers' own: the model pools the logit at the last token that is not
``config.pad_token_id`` (the ids end with a token that is not: rollout/reward_text.py);
right padding leaves every real token's position and attention as they are for the text
alone. An RM whose config has no pad token scores one text per forward (transformers
reads the last token then). The manager splits a rollout's texts
between the actors and combines the parts (rollout/reward_parts/).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rollout.reward_config import RewardModelConfig
from rollout.reward_text import reward_input_ids


def _dtype(config: RewardModelConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)


class RewardModel:
    """One reward actor: the RM in eval mode and its tokenizer."""

    def __init__(self, config: RewardModelConfig, num_threads: int = 1) -> None:
        torch.set_num_threads(max(1, num_threads))
        self.device = torch.device("cuda" if config.num_gpus > 0 and torch.cuda.is_available()
                                   else "cpu")
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            config.path, dtype=_dtype(config, self.device),
            use_safetensors=True).to(self.device)  # data, never a pickle
        self.model.eval()
        self.model.requires_grad_(False)
        self.pad_id = self.model.config.pad_token_id
        self.batch_size = config.batch_size if self.pad_id is not None else 1
        context = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = config.max_length or context

    def ping(self) -> bool:
        return True

    def input_ids(self, prompts: list[Any], responses: list[str]) -> list[list[int]]:
        """Each sample's ids (rollout/reward_text.py), its last ``max_length`` kept."""
        ids = [reward_input_ids(self.tokenizer, p, r, self.config.chat_template)
               for p, r in zip(prompts, responses, strict=True)]
        return [row[-self.max_length:] if self.max_length else row for row in ids]

    @torch.no_grad()
    def score(self, prompts: list[Any], responses: list[str]) -> tuple[list[float], float]:
        """(each text's score, the seconds it took): right-padded batches, pooled by
        transformers at the last token that is not the pad token."""
        started = time.perf_counter()
        ids, scores = self.input_ids(prompts, responses), []
        for start in range(0, len(ids), self.batch_size):
            rows = ids[start:start + self.batch_size]
            width = max(len(row) for row in rows)
            pad = self.pad_id if self.pad_id is not None else 0
            input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
            attention = torch.tensor([[1] * len(row) + [0] * (width - len(row))
                                      for row in rows])
            logits = self.model(input_ids=input_ids.to(self.device),
                                attention_mask=attention.to(self.device)).logits
            scores += logits[:, 0].float().cpu().tolist()
        return scores, time.perf_counter() - started
