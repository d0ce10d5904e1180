r"""What a reward model scores: the one definition its trainer (``tally train-rm``) and the
reward actors (``rollout.reward`` ``type: model``, rollout/reward_model.py) share.

    text(prompt, response) = prompt + response                     chat_template: false
                           = template(messages(prompt) + [assistant: response])
                                                                   chat_template: true

``messages(prompt)`` (:func:`prompt_messages`): a string prompt is one user message; a
list of chat messages is itself. Without a chat template a list's contents are joined
with nothing between them (what the tiny model's template does), then the response. The
template is the reward model's own tokenizer's (``apply_chat_template(...,
tokenize=False)``, no generation prompt).

    ids(prompt, response) = tokenizer(text, add_special_tokens=True) without its
                            trailing pad tokens, then its last max_length tokens
    r(prompt, response)   = the score head's output at the last token of ids

which is what ``AutoModelForSequenceClassification`` (one label) computes on the text at
its last token that is not ``pad_token_id`` (a causal model's earlier tokens never see
the pads after them), so an actor that right-pads these ids and pools the logit there
scores exactly what ``tally train-rm`` trained. (A tokenizer's own left truncation would
differ: it keeps the special tokens it adds, e.g. a ``<bos>``.)
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, Any]]


def prompt_messages(prompt: str | Messages) -> Messages:
    """A prompt as chat messages: a string is one user message; a list, a copy of it."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(message) for message in prompt]


def reward_text(tokenizer: Any, prompt: str | Messages, response: str,
                chat_template: bool) -> str:
    """The text a reward model scores for ``response`` to ``prompt`` (module docstring)."""
    if not chat_template:
        if isinstance(prompt, str):
            return prompt + response
        return "".join(str(message.get("content", "")) for message in prompt) + response
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat_template: true, but the reward model's tokenizer has no "
                         "chat template")
    messages = [*prompt_messages(prompt), {"role": "assistant", "content": response}]
    return tokenizer.apply_chat_template(messages, tokenize=False)


def reward_input_ids(tokenizer: Any, prompt: str | Messages, response: str,
                     chat_template: bool, max_length: int | None = None) -> list[int]:
    """The token ids a reward model scores (module docstring); r is read at the last."""
    text = reward_text(tokenizer, prompt, response, chat_template)
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    pad = tokenizer.pad_token_id
    while ids and pad is not None and ids[-1] == pad:
        ids.pop()
    return ids[-max_length:] if max_length is not None else ids
