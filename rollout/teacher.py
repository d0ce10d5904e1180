"""A teacher model's log-probs of what the policy sampled: on-policy distillation.

    RolloutBatch (prompt + response ids) ─► teacher actors (a torch forward each, its
    samples split between them) ─► log π_teacher [N, S] of every response token

The manager asks for them once per rollout, after the rewards, and turns them into
per-token advantages (rollout/advantages/distill.py: ``distill_advantages``). The teacher scores
at the sampling temperature T (log-softmax of logits / T), the distribution the rollout's
own log-probs are of, so the gap between the two is the reverse KL of the policy that
sampled to the teacher at that temperature. A teacher shares the policy's tokenizer
(checked before a job starts, services/runtime/preflight.py): its ids are the policy's.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rollout.config import TeacherConfig
from rollout.engines.sampling import scaled_logits


def response_log_probs(model: torch.nn.Module, input_ids: torch.Tensor,
                       prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                       temperature: float, batch_size: int) -> torch.Tensor:
    """log softmax(logits / T) of each response token under ``model`` (the engine's
    reported log-prob, rollout/engines/sampling.scaled_logits): [N, S] float32,
    aligned with ``input_ids`` (position t holds the log-prob of token t, from the logits
    at t − 1), 0 off the responses. Right-padded rows, ``batch_size`` rows per forward."""
    num_samples, width = input_ids.shape
    device = next(model.parameters()).device
    out = torch.zeros(num_samples, width, dtype=torch.float32)
    ends = prompt_lengths + response_lengths
    for start in range(0, num_samples, batch_size):
        rows = slice(start, min(start + batch_size, num_samples))
        length = int(ends[rows].max())
        ids = input_ids[rows, :length].to(device)
        attention = (torch.arange(length)[None, :] < ends[rows, None]).to(device)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention.long()).logits[:, :-1]
            log_probs = scaled_logits(logits, temperature).log_softmax(dim=-1)
            picked = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
        position = torch.arange(1, length)[None, :]
        in_response = (position >= prompt_lengths[rows, None]) & (position < ends[rows, None])
        out[rows, 1:length] = torch.where(in_response, picked, 0.0)
    return out


class Teacher:
    """One teacher actor: the model in eval mode, asked for log-probs of sampled tokens."""

    def __init__(self, config: TeacherConfig, model_path: str, num_threads: int = 1) -> None:
        torch.set_num_threads(max(1, num_threads))
        device = torch.device("cuda" if config.num_gpus > 0 and torch.cuda.is_available()
                              else "cpu")
        dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) \
            if config.dtype == "auto" else getattr(torch, config.dtype)
        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
        self.model.eval()
        self.model.requires_grad_(False)

    def ping(self) -> bool:
        return True

    def log_probs(self, input_ids: torch.Tensor, prompt_lengths: torch.Tensor,
                  response_lengths: torch.Tensor, temperature: float) -> Any:
        """:func:`response_log_probs` of these rows (numpy: Ray carries it without a
        copy)."""
        return response_log_probs(self.model, input_ids, prompt_lengths, response_lengths,
                                  temperature, self.config.batch_size).numpy()
