r"""What a reward model scores: the one tokenization its trainer (``tally train-rm``,
services/train_rm/data.py), the reward actors (rollout/reward_model.py) and the tests
share.

    ids(prompt, response) = tokenizer.apply_chat_template(
                                messages(prompt) + [assistant: response], tokenize=True)
                                                                   chat_template: true
                          = tokenizer(prompt + response), special tokens added once
                                                                   chat_template: false
    r(prompt, response)   = the score head's output at the last of those ids

``messages(prompt)`` (:func:`prompt_messages`): a string prompt is one user message; a
list of chat messages is itself. Without a template a list's contents are joined with
nothing between them, then the response. ``prompt`` is the record's own prompt (the
dataset's text or messages), never the policy's templated text: the same pair scores the
same ids in train-rm and in a job, whatever the policy's template.

*Special tokens once.* ``apply_chat_template(tokenize=True)`` tokenizes the rendered text
without adding special tokens (a template that writes ``{{ bos_token }}`` gets one BOS),
as TRL, OpenRLHF and verl do; rendering to text and tokenizing that with special tokens
would add a second. Without a template, the tokens the tokenizer adds around a text
(its BOS, say) are left out where the text already starts (or ends) with them.

*The last id* is where the score is read, an EOS included: never "the last token that is
not ``pad_token_id``" (transformers' pooling, one token early when the pad token is the
EOS the template ends with).

*Too long* (more than ``max_length`` ids), by ``truncation``:

    left    keep the kept prefix, then the last max_length − |prefix| ids (the end, where
            the score is read). The kept prefix: with a template, the ids before the
            first non-system message's content (BOS, system prompt, the template's
            opening), found as the common start of these ids and those of the same
            conversation with that content changed; without, the leading special ids.
            A prefix that leaves no room keeps only its leading special ids.
    right   the first max_length ids
    refuse  RewardTextTooLong (a reward actor leaves the sample unscored)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Messages = list[dict[str, Any]]
Truncation = Literal["left", "right", "refuse"]


class RewardTextTooLong(ValueError):
    """A text longer than ``max_length`` under ``truncation: refuse``."""


@dataclass(frozen=True)
class RewardIds:
    """One text's ids as the reward model scores them."""

    ids: list[int]
    """The ids, cut to ``max_length``; the score is read at the last."""
    num_tokens: int
    """Its ids before any cut."""

    @property
    def truncated(self) -> bool:
        return len(self.ids) < self.num_tokens


def prompt_messages(prompt: str | Messages) -> Messages:
    """A prompt as chat messages: a string is one user message; a list, a copy of it."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(message) for message in prompt]


def plain_text(prompt: str | Messages, response: str) -> str:
    """The text without a template: the prompt (a list's contents joined), the response."""
    if isinstance(prompt, str):
        return prompt + response
    return "".join(str(message.get("content", "")) for message in prompt) + response


def _as_ids(encoded: Any) -> list[int]:
    """``input_ids`` of what a tokenizer returns (transformers 5's ``apply_chat_template``
    returns a BatchEncoding; older versions a list)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def _template_ids(tokenizer: Any, messages: Messages) -> list[int]:
    return _as_ids(tokenizer.apply_chat_template(messages, tokenize=True))


def _specials_once(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer(text)`` with the special tokens it adds around the text, except those
    the text already starts or ends with (module docstring)."""
    added = _as_ids(tokenizer(text, add_special_tokens=True))
    bare = _as_ids(tokenizer(text, add_special_tokens=False))
    width = len(bare)
    start = next((p for p in range(len(added) - width + 1) if added[p:p + width] == bare),
                 None)
    if start is None:  # the added tokens are not around the text: left as they are
        return added
    prefix, suffix = added[:start], added[start + width:]
    if prefix and bare[:len(prefix)] == prefix:
        prefix = []
    if suffix and bare[len(bare) - len(suffix):] == suffix:
        suffix = []
    return prefix + bare + suffix


def _check_template(tokenizer: Any) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat_template: true, but the reward model's tokenizer has no "
                         "chat template")


def full_ids(tokenizer: Any, prompt: str | Messages, response: str,
             chat_template: bool) -> list[int]:
    """The ids of (prompt, response) before any cut (module docstring)."""
    if not chat_template:
        return _specials_once(tokenizer, plain_text(prompt, response))
    _check_template(tokenizer)
    return _template_ids(tokenizer, [*prompt_messages(prompt),
                                     {"role": "assistant", "content": response}])


def _leading_specials(tokenizer: Any, ids: list[int]) -> int:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    count = 0
    while count < len(ids) and ids[count] in special:
        count += 1
    return count


def kept_prefix(tokenizer: Any, ids: list[int], prompt: str | Messages, response: str,
                chat_template: bool) -> int:
    """How many leading ids of ``ids`` left truncation keeps (module docstring)."""
    specials = _leading_specials(tokenizer, ids)
    if not chat_template:
        return specials
    messages = [*prompt_messages(prompt), {"role": "assistant", "content": response}]
    first = next(k for k, m in enumerate(messages) if m.get("role") != "system")
    content = str(messages[first].get("content", ""))
    messages[first] = {**messages[first], "content": "y" if content.startswith("x") else "x"}
    other = _template_ids(tokenizer, messages)
    common = 0
    while common < min(len(ids), len(other)) and ids[common] == other[common]:
        common += 1
    return max(common, specials)


def encode_reward(tokenizer: Any, prompt: str | Messages, response: str,
                  chat_template: bool, max_length: int | None = None,
                  truncation: Truncation = "left") -> RewardIds:
    """The ids a reward model scores (module docstring), cut to ``max_length``."""
    ids = full_ids(tokenizer, prompt, response, chat_template)
    if max_length is None or len(ids) <= max_length:
        return RewardIds(ids, len(ids))
    if truncation == "refuse":
        raise RewardTextTooLong(f"{len(ids)} tokens, more than max_length {max_length} "
                                "(truncation: refuse)")
    if truncation == "right":
        return RewardIds(ids[:max_length], len(ids))
    keep = kept_prefix(tokenizer, ids, prompt, response, chat_template)
    if keep >= max_length:
        keep = min(_leading_specials(tokenizer, ids), max_length - 1)
    return RewardIds(ids[:keep] + ids[len(ids) - (max_length - keep):], len(ids))


def reward_input_ids(tokenizer: Any, prompt: str | Messages, response: str,
                     chat_template: bool, max_length: int | None = None,
                     truncation: Truncation = "left") -> list[int]:
    """The ids of :func:`encode_reward`; the score is read at the last."""
    return encode_reward(tokenizer, prompt, response, chat_template, max_length,
                         truncation).ids
