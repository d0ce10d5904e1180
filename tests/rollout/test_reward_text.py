"""The ids a reward model scores (rollout/reward_text.py): the chat template's own
``apply_chat_template(tokenize=True)`` ids, or the text with special tokens added once;
over max_length, left truncation keeps the leading special tokens and the template's
prefix, right keeps the start, refuse raises."""

from __future__ import annotations

import pytest

from rollout.reward_text import (
    RewardTextTooLong,
    encode_reward,
    kept_prefix,
    plain_text,
    prompt_messages,
    reward_input_ids,
)
from rollout.tiny import resolve_model_path
from rollout.tokenizer import load_tokenizer

CHAT = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "2+2="}]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return load_tokenizer(resolve_model_path("tiny"))


def test_plain_text_is_prompt_then_response() -> None:
    assert plain_text("2+2=", "4") == "2+2=4"
    assert plain_text(CHAT, "4") == "Be brief. 2+2=4"
    assert prompt_messages("hi") == [{"role": "user", "content": "hi"}]
    assert prompt_messages(CHAT) == CHAT and prompt_messages(CHAT) is not CHAT


def test_template_ids_are_apply_chat_template_ids_one_bos(tiny_tokenizer) -> None:
    """The tiny template writes ``{{ bos_token }}`` and the tokenizer adds BOS too: the
    ids hold one BOS, exactly apply_chat_template(tokenize=True)'s."""
    want = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}],
        tokenize=True)["input_ids"]
    ids = reward_input_ids(tiny_tokenizer, "2+2=", "4", chat_template=True)
    assert ids == list(want) == tiny_tokenizer("2+2=4")["input_ids"]
    assert ids.count(tiny_tokenizer.bos_token_id) == 1


def test_plain_ids_add_special_tokens_once(tiny_tokenizer) -> None:
    bos = tiny_tokenizer.bos_token_id
    want = tiny_tokenizer("abcde")["input_ids"]
    assert want[0] == bos and want.count(bos) == 1
    assert reward_input_ids(tiny_tokenizer, "abc", "de", chat_template=False) == want
    # a prompt that already holds the BOS text (a templated policy prompt): not re-added
    assert reward_input_ids(tiny_tokenizer, "<bos>abc", "de", chat_template=False) == want
    # the pad token is an id like any other: read where it stands, never dropped
    padded = reward_input_ids(tiny_tokenizer, "abc", "de<pad>", chat_template=False)
    assert padded == [*want, tiny_tokenizer.pad_token_id]


def test_left_truncation_keeps_bos_and_the_end(tiny_tokenizer) -> None:
    ids = reward_input_ids(tiny_tokenizer, "abcdefgh", "ij", chat_template=False)
    encoded = encode_reward(tiny_tokenizer, "abcdefgh", "ij", False, max_length=4)
    assert encoded.ids == [ids[0], *ids[-3:]] and encoded.truncated
    assert encoded.num_tokens == len(ids) == 11
    right = encode_reward(tiny_tokenizer, "abcdefgh", "ij", False, 4, truncation="right")
    assert right.ids == ids[:4]
    with pytest.raises(RewardTextTooLong, match="11 tokens, more than max_length 4"):
        encode_reward(tiny_tokenizer, "abcdefgh", "ij", False, 4, truncation="refuse")
    fits = encode_reward(tiny_tokenizer, "abcdefgh", "ij", False, 11, truncation="refuse")
    assert fits.ids == ids and not fits.truncated


def test_left_truncation_keeps_the_template_prefix(smollm2_path) -> None:
    """SmolLM2: the kept prefix is its template up to the question (its system prompt
    included); the rest is the end of the text, where the score is read."""
    smol = load_tokenizer(smollm2_path)
    question = "Tom has " + "many " * 40 + "apples. How many?"
    ids = reward_input_ids(smol, question, "Seven.", chat_template=True)
    keep = kept_prefix(smol, ids, question, "Seven.", True)
    assert smol.decode(ids[:keep]).endswith("<|im_start|>user\n")
    assert "You are a helpful AI assistant" in smol.decode(ids[:keep])
    cut = encode_reward(smol, question, "Seven.", True, max_length=keep + 10)
    assert cut.ids == ids[:keep] + ids[-10:] and cut.truncated
    assert smol.decode(cut.ids[-10:]).endswith("Seven.<|im_end|>\n")
    # a system message of the record's own is part of the prefix too
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    chat_ids = reward_input_ids(smol, chat, "Seven.", chat_template=True)
    assert smol.decode(chat_ids[:kept_prefix(smol, chat_ids, chat, "Seven.", True)]
                       ).endswith("Be brief.<|im_end|>\n<|im_start|>user\n")
    # a prefix longer than max_length keeps only its leading special tokens
    short = encode_reward(smol, question, "Seven.", True, max_length=5)
    assert short.ids == ids[:1] + ids[-4:] and ids[0] == smol.convert_tokens_to_ids(
        "<|im_start|>")


def test_no_template_is_refused(tiny_tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="has no chat template"):
        reward_input_ids(bare, "a", "b", chat_template=True)
