"""Reward-model actors: a Hugging Face ``AutoModelForSequenceClassification`` with one
label scoring (prompt, response) pairs (``rollout.reward`` part of ``type: model``).

    (record prompt, response) ─► ids (rollout/reward_text.py, the one tokenization
                                  train-rm shares; cut by max_length / truncation)
                              ─► right-padded batches ─► decoder ─► score head
                              ─► the head's output at each row's last real id

The score is read by index, at position ``len(ids) − 1`` of each row (the attention mask's
last 1), never by transformers' search for the last token that is not
``config.pad_token_id``: that search reads one token early when the pad token is the EOS
a template ends with (train-rm sets pad = EOS for a tokenizer without a pad token, as
TRL does). It is what train-rm's ranks compute (trainer/backends/fsdp/reward_model.py:
decoder, head, the last token of each sequence). Right padding leaves every real
token's position and attention as they are for the ids alone.

Unset ``chat_template`` / ``max_length`` come from the folder's tally_reward_model.json
(rollout/reward_model_info.py). The manager splits a rollout's samples between the
actors and combines the parts (rollout/reward_parts/).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rollout.reward_config import RewardModelConfig
from rollout.reward_model_info import served_config
from rollout.reward_text import RewardTextTooLong, encode_reward


def _dtype(config: RewardModelConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)


def last_id_scores(model: Any, rows: list[list[int]], pad_id: int = 0) -> torch.Tensor:
    """[len(rows)]: the score head's output at each row's last id, the rows right-padded
    into one batch (module docstring). A model without a ``score`` head (not a causal
    LM's sequence classifier) is run one row at a time with no pad token in its config,
    where transformers itself reads the last token."""
    device = next(model.parameters()).device
    head = getattr(model, "score", None)
    if head is None:
        model.config.pad_token_id = None
        return torch.stack([model(input_ids=torch.tensor([row], device=device)).logits[0, 0]
                            for row in rows])
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows],
                             device=device)
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows],
                             device=device)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention).last_hidden_state
    last = attention.sum(dim=1) - 1  # each row's last real id, by its own index
    return head(hidden[torch.arange(len(rows), device=device), last])[:, 0]


class RewardModel:
    """One reward actor: the RM in eval mode and its tokenizer."""

    def __init__(self, config: RewardModelConfig, num_threads: int = 1) -> None:
        torch.set_num_threads(max(1, num_threads))
        config = served_config(config)  # a part's start gives it resolved already
        self.device = torch.device("cuda" if config.num_gpus > 0 and torch.cuda.is_available()
                                   else "cpu")
        self.config = config
        self.chat_template = bool(config.chat_template)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            config.path, dtype=_dtype(config, self.device),
            use_safetensors=True).to(self.device)  # data, never a pickle
        self.model.eval()
        self.model.requires_grad_(False)
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0  # any id: it is never read
        context = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = config.max_length or context

    def ping(self) -> bool:
        return True

    def input_ids(self, prompts: list[Any], responses: list[str]
                  ) -> tuple[list[list[int] | None], int]:
        """Each sample's ids (rollout/reward_text.py; None: over max_length under
        ``truncation: refuse``) and how many were over max_length."""
        ids: list[list[int] | None] = []
        over = 0
        for prompt, response in zip(prompts, responses, strict=True):
            try:
                encoded = encode_reward(self.tokenizer, prompt, response, self.chat_template,
                                        self.max_length, self.config.truncation)
            except RewardTextTooLong:
                ids.append(None)
                over += 1
                continue
            ids.append(encoded.ids)
            over += encoded.truncated
        return ids, over

    @torch.no_grad()
    def score(self, prompts: list[Any], responses: list[str]
              ) -> tuple[list[float | None], float, int]:
        """(each sample's score, None where refused; the seconds it took; texts over
        max_length): right-padded batches, each read at its last real id."""
        started = time.perf_counter()
        ids, over = self.input_ids(prompts, responses)
        scores: list[float | None] = [None] * len(ids)
        real = [i for i, row in enumerate(ids) if row is not None]
        for start in range(0, len(real), self.config.batch_size):
            chunk = real[start:start + self.config.batch_size]
            values = last_id_scores(self.model, [ids[i] for i in chunk], self.pad_id)
            for i, value in zip(chunk, values.float().cpu().tolist(), strict=True):
                scores[i] = value
        return scores, time.perf_counter() - started, over
