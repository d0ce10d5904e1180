"""How an environment's words become tokens of an episode: its first observation is the
prompt, each later one is appended after the policy's action.

    chat model:  first = the user turn with the generation prompt (as any prompt)
                 later = [the end of the assistant's turn] + a new user (or tool) turn
                         + the generation prompt, as the chat template writes them
    plain model: first = the text tokenized as a prompt; later = the text's tokens

The policy's tokens are never re-tokenized: an episode is the concatenation of token ids
exactly as sampled and as appended, so the trainer's teacher-forced pass sees what the
engine saw. A later turn's text is what the template adds to a conversation when that
turn is appended (rendered once for placeholder messages, then filled in), so a turn
costs one tokenizer call, not a render of the whole conversation. When the action ended
on the end-of-turn token the template would write itself, that token is not written
twice.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from rollout.tokenizer import encode_prompt

_USER, _ACTION, _OBSERVATION = "\x00user\x00", "\x00action\x00", "\x00observation\x00"
"""Placeholder contents no real turn holds (rendered once, then split on)."""


class TurnFormat:
    """Token ids of observations for one tokenizer (chat template or plain text)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, apply_chat_template: bool,
                 observation_role: str = "user") -> None:
        self.tokenizer = tokenizer
        self.chat = apply_chat_template
        self.close_turn = self.open_turn = self.after_observation = ""
        if self.chat:
            self.close_turn, self.open_turn, self.after_observation = _turn_texts(
                tokenizer, observation_role)

    @property
    def filler_token(self) -> int:
        """A token that stands where an episode has none of its own (its reset failed;
        masked out): EOS, else the pad token."""
        token = self.tokenizer.eos_token_id
        return int(token if token is not None else self.tokenizer.pad_token_id or 0)

    def first(self, observation: str) -> list[int]:
        """The prompt: the first observation as the user turn (chat) or plain text."""
        return encode_prompt(self.tokenizer, observation, self.chat)

    def later(self, observation: str, action_ids: list[int]) -> list[int]:
        """The tokens appended after the policy's action ``action_ids``: for a chat
        model the rest of the assistant turn, the observation's turn and the next
        generation prompt; else the observation's text."""
        if not self.chat:
            return self.tokenizer.encode(observation, add_special_tokens=False)
        close = self.close_turn
        if action_ids:  # ended on the end-of-turn token the template writes: not twice
            last = self.tokenizer.decode(action_ids[-1:], skip_special_tokens=False)
            if last and close.startswith(last):
                close = close[len(last):]
        text = close + self.open_turn + observation + self.after_observation
        return self.tokenizer.encode(text, add_special_tokens=False)


def _turn_texts(tokenizer: PreTrainedTokenizerBase, role: str) -> tuple[str, str, str]:
    """(what closes an assistant turn after its content, what opens an observation turn
    before its content, what follows the observation up to the next generation prompt),
    read off the chat template with placeholder messages."""
    before = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ACTION}]
    after = [*before, {"role": role, "content": _OBSERVATION}]
    base = tokenizer.apply_chat_template(before, tokenize=False)
    full = tokenizer.apply_chat_template(after, tokenize=False, add_generation_prompt=True)
    if not full.startswith(base) or base.count(_ACTION) != 1 or full.count(_OBSERVATION) != 1:
        raise ValueError(
            f"rollout.environment.observation_role: the tokenizer's chat template does not "
            f"append a {role!r} turn to a conversation (it rewrites earlier turns); use "
            "observation_role: user, or rollout.apply_chat_template: false")
    close_turn = base[base.index(_ACTION) + len(_ACTION):]
    open_turn, after_observation = full[len(base):].split(_OBSERVATION)
    return close_turn, open_turn, after_observation
