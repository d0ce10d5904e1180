"""The rollout side of a logged training sample's per-token view (``SampleTokens``,
rollout/sample_record.py), made where the tokenizer is: the manager.

    Sample ─► text (each response id decoded alone, special tokens kept),
              observation (an episode's mask 0), the engine's log-prob (None there);
              advantage 0 and trainer log-prob / entropy None until the driver fills
              them from the batch and the trainer (services/driver/sample_tokens.py)

A token decoded alone can differ from its share of the decoded response (a byte-level
BPE piece of a multi-byte character reads "\ufffd"); it is what the model saw.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from rollout.rollouts.base import Sample
from rollout.sample_record import SampleTokens


def token_texts(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> list[str]:
    """Each id decoded alone, special tokens kept (``<eos>``, a chat turn's markers)."""
    return [tokenizer.decode([token], skip_special_tokens=False) for token in token_ids]


def response_tokens(sample: Sample, tokenizer: PreTrainedTokenizerBase) -> SampleTokens:
    """``sample``'s response token by token as rollout knows it (module docstring)."""
    ids = sample.generation.token_ids
    observation = ([False] * len(ids) if sample.mask is None
                   else [not bool(m) for m in sample.mask])
    return SampleTokens(
        text=token_texts(tokenizer, ids), observation=observation,
        advantage=[0.0] * len(ids),
        engine_log_prob=[None if obs else float(lp) for obs, lp
                         in zip(observation, sample.generation.log_probs, strict=True)],
        trainer_log_prob=[None] * len(ids), entropy=[None] * len(ids))
