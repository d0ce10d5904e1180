"""Observations as tokens: appended turn by turn, a chat episode reads exactly as the
chat template writes the whole conversation."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.tokenizer import load_tokenizer
from rollout.turns import TurnFormat


@pytest.mark.parametrize("role", ["user", "tool"])
def test_chat_turns_concatenate_to_the_templates_conversation(smollm2_path: Path,
                                                              role: str) -> None:
    tokenizer = load_tokenizer(smollm2_path)
    turns = TurnFormat(tokenizer, apply_chat_template=True, observation_role=role)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The first action ends at a stop string (no end-of-turn token: the turn is closed for
    # it), the second at EOS (the template's own end-of-turn token is not written twice).
    first_action = tokenizer.encode("Let me <calc>12*7</calc>", add_special_tokens=False)
    second_action = [*tokenizer.encode("So \\boxed{84}.", add_special_tokens=False),
                     end_of_turn]
    ids = (turns.first("What is 12*7?") + first_action
           + turns.later("<result>84</result>", first_action) + second_action
           + turns.later("Correct.", second_action))
    conversation = [{"role": "user", "content": "What is 12*7?"},
                    {"role": "assistant", "content": "Let me <calc>12*7</calc>"},
                    {"role": role, "content": "<result>84</result>"},
                    {"role": "assistant", "content": "So \\boxed{84}."},
                    {"role": role, "content": "Correct."}]
    expected = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=True)
    assert tokenizer.decode(ids) == expected
    assert ids.count(end_of_turn) == expected.count("<|im_end|>")


def test_plain_models_append_the_observation_text(tiny_model_path: str) -> None:
    tokenizer = load_tokenizer(tiny_model_path)
    turns = TurnFormat(tokenizer, apply_chat_template=False)
    assert tokenizer.decode(turns.later(" lower.\n", [70, 71])) == " lower.\n"
    assert turns.first("guess:") == list(tokenizer("guess:")["input_ids"])
