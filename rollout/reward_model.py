"""Reward-model actors: a Hugging Face ``AutoModelForSequenceClassification`` with one
label scoring (prompt, response) pairs (``rollout.reward`` part of ``type: model``).

    (record prompt, response) ─► ids (rollout/reward_text.py, the one tokenization
                                  train-rm shares; cut by max_length / truncation)
                              ─► batches by tokens ─► right-padded ─► decoder ─► score head
                              ─► the head's output at each row's last real id

Batches by tokens: the rows sorted longest first (padding stays small), each batch as many
rows as keep rows × its longest row ≤ ``max_tokens_per_batch`` (and ≤ ``batch_size`` rows
when set); a row over the budget alone is a batch of its own. A batch whose forward raises
``torch.OutOfMemoryError`` (CUDA's is one) is halved and each half tried again, down to one
row; one row that still does not fit raises :class:`RewardModelOOM` naming the part. The
halvings are counted (``reward/<name>/oom_retries``). Scores go back in the samples' order.

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
from typing import Any, NamedTuple

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


class RewardModelOOM(RuntimeError):
    """One text alone does not fit in the reward actor's memory."""


class ShardScores(NamedTuple):
    """What a reward actor returns for its share of a shard."""

    values: list[float | None]
    """Each sample's score in the order given; None where refused (over max_length)."""
    busy_s: float
    """Seconds it took."""
    truncated: int
    """Texts over max_length."""
    oom_retries: int
    """Batches halved after an out-of-memory error."""


def token_batches(lengths: list[int], max_tokens: int, max_rows: int | None = None
                  ) -> list[list[int]]:
    """Indices into ``lengths`` in batches: longest first, each batch as many rows as
    keep rows × its longest ≤ ``max_tokens`` (at most ``max_rows``); a row longer than
    ``max_tokens`` alone."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches:
            batch = batches[-1]
            longest = lengths[batch[0]]  # sorted: the first is the longest
            if (len(batch) + 1) * longest <= max_tokens and (
                    max_rows is None or len(batch) < max_rows):
                batch.append(i)
                continue
        batches.append([i])
    return batches


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

    def score(self, prompts: list[Any], responses: list[str]
              ) -> tuple[list[float | None], float, int]:
        """(each sample's score, None where refused; the seconds it took; texts over
        max_length): :meth:`score_shard` without its retry count."""
        values, busy_s, truncated, _ = self.score_shard(prompts, responses)
        return values, busy_s, truncated

    @torch.no_grad()
    def score_shard(self, prompts: list[Any], responses: list[str]) -> ShardScores:
        """Each sample's score in its order, batched by tokens (module docstring), each
        batch right-padded and read at its rows' last real ids."""
        started = time.perf_counter()
        ids, over = self.input_ids(prompts, responses)
        scores: list[float | None] = [None] * len(ids)
        real = [i for i, row in enumerate(ids) if row is not None]
        lengths = [len(ids[i] or ()) for i in real]
        pending = [[real[k] for k in batch] for batch in reversed(token_batches(
            lengths, self.config.max_tokens_per_batch, self.config.batch_size))]
        retries = 0
        while pending:  # a stack: a halved batch's halves are tried next, in order
            batch = pending.pop()
            try:
                values = last_id_scores(self.model, [ids[i] or [] for i in batch],
                                        self.pad_id).float().cpu().tolist()
            except torch.OutOfMemoryError as err:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # the failed batch's activations
                if len(batch) == 1:
                    raise RewardModelOOM(
                        f"reward {self.config.part_name}: one text of "
                        f"{len(ids[batch[0]] or ())} tokens does not fit in the reward "
                        f"actor's memory even alone; lower max_length or give it more "
                        f"memory ({err})") from None
                retries += 1
                half = len(batch) // 2
                pending += [batch[half:], batch[:half]]
                continue
            for i, value in zip(batch, values, strict=True):
                scores[i] = value
        return ShardScores(scores, time.perf_counter() - started, over, retries)
