"""The text a reward model scores, and its tokens: one definition (rollout/reward_text.py),
the same as transformers' pooling on a right-padded, left-truncated batch."""

from __future__ import annotations

import pytest
import torch

from rollout.reward_text import prompt_messages, reward_input_ids, reward_text
from rollout.tiny import resolve_model_path
from rollout.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return load_tokenizer(resolve_model_path("tiny"))


def test_plain_text_is_prompt_then_response(tiny_tokenizer) -> None:
    assert reward_text(tiny_tokenizer, "2+2=", "4", chat_template=False) == "2+2=4"
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "2+2="}]
    assert reward_text(tiny_tokenizer, messages, "4", chat_template=False) == "Be brief. 2+2=4"
    assert prompt_messages("hi") == [{"role": "user", "content": "hi"}]
    assert prompt_messages(messages) == messages and prompt_messages(messages) is not messages


def test_chat_template_gets_the_assistant_turn(tiny_tokenizer, smollm2_path) -> None:
    # the tiny model's template: <bos> then every message's content
    assert reward_text(tiny_tokenizer, "2+2=", "4", chat_template=True) == "<bos>2+2=4"
    smol = load_tokenizer(smollm2_path)
    text = reward_text(smol, [{"role": "user", "content": "2+2?"}], "4", chat_template=True)
    assert text == smol.apply_chat_template([{"role": "user", "content": "2+2?"},
                                             {"role": "assistant", "content": "4"}],
                                            tokenize=False)
    assert text.endswith("<|im_start|>assistant\n4<|im_end|>\n")
    assert reward_text(smol, "2+2?", "4", chat_template=True) == text  # a string: one user turn


def test_ids_keep_the_end_and_drop_trailing_pads(tiny_tokenizer) -> None:
    ids = reward_input_ids(tiny_tokenizer, "abc", "de", chat_template=False)
    assert ids == tiny_tokenizer("abcde")["input_ids"] and ids[0] == tiny_tokenizer.bos_token_id
    assert reward_input_ids(tiny_tokenizer, "abc", "de", False, max_length=3) == ids[-3:]
    padded = reward_input_ids(tiny_tokenizer, "abc", "de<pad><pad>", chat_template=False)
    assert padded == ids  # <pad> is the tokenizer's pad token: not where r is read


def test_transformers_pooling_of_a_padded_batch_reads_the_same_token(tiny_tokenizer) -> None:
    """What a reward actor does (these ids right-padded into one batch with an attention
    mask, AutoModelForSequenceClassification's own pooling) scores each text as its ids
    alone, read at the last token; a trailing pad token and truncation change nothing."""
    from transformers import AutoModelForSequenceClassification

    pad = tiny_tokenizer.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        resolve_model_path("tiny"), num_labels=1, pad_token_id=pad)
    texts = [("What is 2+2?", "4"), ("A longer prompt than the others, cut", " on the left."),
             ("x", "y<pad>")]
    rows = [reward_input_ids(tiny_tokenizer, p, r, False, max_length=20) for p, r in texts]
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    with torch.no_grad():
        batched = model(input_ids=input_ids, attention_mask=attention).logits[:, 0]
        for row, score in zip(rows, batched, strict=True):
            alone = model(input_ids=torch.tensor([row])).logits[0, 0]
            assert torch.allclose(score, alone, atol=1e-5), row
    assert len(rows[1]) == 20 and rows[1][-1] == tiny_tokenizer("x.")["input_ids"][-1]
