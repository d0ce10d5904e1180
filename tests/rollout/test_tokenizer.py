"""The character tokenizer and the tiny checkpoint: round trips, determinism, caching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.tiny import create_tiny_checkpoint, resolve_model_path
from rollout.tokenizer import (
    build_char_tokenizer,
    decode_responses,
    encode_completion,
    encode_prompt,
    encode_prompts,
    is_char_tokenizer_dir,
    load_tokenizer,
)

TEXT = "rev  abc = x\\boxed{12}, ok?\nnext line  "


def test_char_tokenizer_round_trip_survives_save_and_load(tmp_path: Path) -> None:
    build_char_tokenizer().save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')  # what trips AutoTokenizer
    tokenizer = load_tokenizer(tmp_path)
    ids = tokenizer(TEXT)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(TEXT) + 1  # one id per char
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert is_char_tokenizer_dir(tmp_path)
    # The reason load_tokenizer exists: Auto picks a byte-level tokenizer and loses spaces.
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    assert auto.decode(auto(TEXT)["input_ids"], skip_special_tokens=True) != TEXT


def test_char_tokenizer_specials_and_unknowns() -> None:
    tokenizer = build_char_tokenizer()
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id] == [0, 1, 2]
    assert tokenizer.unk_token_id == 3 and len(tokenizer) == 100
    assert tokenizer("é")["input_ids"] == [1, 3]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "cp ab="}], tokenize=False)
    assert chat == "<bos>cp ab="


def test_prompt_and_completion_encoding() -> None:
    tokenizer = build_char_tokenizer()
    plain = encode_prompt(tokenizer, "cp ab=")
    assert plain == [tokenizer.bos_token_id, *tokenizer.encode("cp ab=", add_special_tokens=False)]
    assert encode_prompt(tokenizer, [{"role": "user", "content": "cp ab="}]) == plain
    assert encode_prompt(tokenizer, "cp ab=", apply_chat_template=True) == plain
    assert encode_completion(tokenizer, "ab") == [
        *tokenizer.encode("ab", add_special_tokens=False),
        2,
    ]


def test_prompts_encoded_together_equal_each_encoded_alone() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                               "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    prompts = ["cp ab=", [{"role": "user", "content": "rev xy="}], "", "q 12=",
               [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]]

    def alone(prompt: str | list[dict[str, str]], chat: bool) -> list[int]:
        """One tokenizer call for this prompt alone, as transformers does it."""
        if isinstance(prompt, str) and not chat:
            return list(tokenizer(prompt)["input_ids"])
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True)["input_ids"])

    for chat in (False, True):
        together = encode_prompts(tokenizer, prompts, apply_chat_template=chat)
        assert together == [alone(p, chat) for p in prompts]
        assert together == [encode_prompt(tokenizer, p, chat) for p in prompts]
        assert len({tuple(ids) for ids in together}) == len(prompts)
    assert encode_prompts(tokenizer, []) == []


def test_responses_decode_as_batch_decode_does(tiny_model_path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    tokenizer = load_tokenizer(tiny_model_path)
    sequences = [torch.randint(0, len(tokenizer), (int(n),), generator=gen).tolist()
                 for n in torch.randint(0, 12, (64,), generator=gen)]
    sequences[0] = [tokenizer.bos_token_id, 5, tokenizer.eos_token_id, tokenizer.pad_token_id]
    want = tokenizer.batch_decode(sequences, skip_special_tokens=True)
    assert decode_responses(tokenizer, sequences) == want
    assert decode_responses(tokenizer, [tuple(s) for s in sequences]) == want
    tokenizer.clean_up_tokenization_spaces = True  # transformers' own path then
    assert decode_responses(tokenizer, sequences) == tokenizer.batch_decode(
        sequences, skip_special_tokens=True)
    assert decode_responses(tokenizer, []) == []


def test_load_tokenizer_rejects_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a local directory"):
        load_tokenizer(tmp_path / "nope")


def test_tiny_checkpoint_is_deterministic_and_loadable(
    tiny_model_path: str, other_tiny_model_path: str, tmp_path: Path
) -> None:
    again = create_tiny_checkpoint(tmp_path / "again", seed=0)
    first = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    second = AutoModelForCausalLM.from_pretrained(again).state_dict()
    other = AutoModelForCausalLM.from_pretrained(other_tiny_model_path).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert list(Path(tiny_model_path).glob("*.safetensors"))
    assert (
        load_tokenizer(tiny_model_path).decode([1, 86, 73, 90], skip_special_tokens=True) == "rev"
    )


def test_resolve_model_path(tmp_path: Path, tiny_model_path: str) -> None:
    resolved = resolve_model_path("tiny", cache_dir=tmp_path)
    assert (Path(resolved) / "config.json").is_file()
    stamp = (Path(resolved) / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("tiny", cache_dir=tmp_path) == resolved  # cached, not rebuilt
    assert (Path(resolved) / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_model_path(tiny_model_path) == tiny_model_path
    with pytest.raises(FileNotFoundError, match=r"model: 'Qwen/Qwen2\.5-0\.5B' is neither 'tiny'"):
        resolve_model_path("Qwen/Qwen2.5-0.5B", cache_dir=tmp_path)
