"""The critic's model on the tiny checkpoint: a fresh value head drawn from
N(0, 1/(d + 1)) with bias 0, a critic's saved head kept, and no dropout anywhere (every
dropout key of the config 0, every ``nn.Dropout`` module's p 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForTokenClassification, Qwen2Config

from rollout.tiny import create_tiny_checkpoint
from trainer.backends.fsdp.value_model import dropouts_off, init_value_head, load_value_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _with_config(tiny_model: str, folder: Path, **changes: object) -> str:
    """The tiny checkpoint's files with ``changes`` made to its config.json."""
    folder.mkdir()
    for file in Path(tiny_model).iterdir():
        if file.name != "config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))
    return str(folder)


def test_a_fresh_head_is_small_and_its_bias_zero(tiny_model: str, tmp_path: Path) -> None:
    """Hugging Face would draw the head with initializer_range (0.5 here): it is 1/(d+1)."""
    torch.manual_seed(0)
    path = _with_config(tiny_model, tmp_path / "wide-init", initializer_range=0.5)
    model = load_value_model(path, torch.float32, CPU)
    head = model.score
    d = model.config.hidden_size
    assert head.weight.shape == (1, d)
    if head.bias is not None:
        assert not head.bias.any()
    # The std of d draws of N(0, s²) is within ~4 standard errors (s/√(2d)) of s.
    s, drawn = 1.0 / (d + 1), float(head.weight.detach().double().std())
    assert abs(drawn - s) < 4 * s / (2 * d) ** 0.5, (drawn, s)


def test_the_head_init_draws_from_its_formula_on_a_wide_layer() -> None:
    """On a layer wide enough to measure: std within 1% of 1/(d + 1), mean ≈ 0, bias 0."""
    head = torch.nn.Linear(20_000, 1)
    init_value_head(head, torch.Generator().manual_seed(0))
    weights = head.weight.double()
    assert float(weights.std()) == pytest.approx(1 / 20_001, rel=0.01)
    assert abs(float(weights.mean())) < 3 / 20_001 / 20_000 ** 0.5
    assert not head.bias.any()


def test_a_critic_folder_keeps_its_head(tiny_model: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    critic = load_value_model(tiny_model, torch.float32, CPU)
    with torch.no_grad():
        critic.score.weight.fill_(0.125)
    critic.save_pretrained(tmp_path / "critic")
    torch.manual_seed(1)  # another draw would differ: the saved head must be read
    again = load_value_model(str(tmp_path / "critic"), torch.float32, CPU)
    assert torch.equal(again.score.weight, critic.score.weight)


def test_every_dropout_is_off(tiny_model: str, tmp_path: Path) -> None:
    """A model folder whose config turns dropouts on: the critic zeroes each of them."""
    folder = _with_config(tiny_model, tmp_path / "with-dropout", attention_dropout=0.3,
                          hidden_dropout=0.2, classifier_dropout=0.4)
    plain = AutoModelForTokenClassification.from_pretrained(folder, num_labels=1)
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in plain.modules())
    model = load_value_model(folder, torch.float32, CPU)
    for key in ("attention_dropout", "hidden_dropout", "classifier_dropout"):
        assert getattr(model.config, key) == 0.0, key
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    model.train()  # dropout would make two forwards differ
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_dropouts_off_walks_nested_configs_and_gpt2_names() -> None:
    config = Qwen2Config(attention_dropout=0.1)
    config.resid_pdrop, config.summary_first_dropout = 0.1, 0.2
    config.text_config = Qwen2Config(attention_dropout=0.5)
    changed = dropouts_off(config)
    assert {"attention_dropout", "resid_pdrop", "summary_first_dropout",
            "text_config.attention_dropout"} <= set(changed)
    assert config.text_config.attention_dropout == 0.0 and config.resid_pdrop == 0.0
    assert config.classifier_dropout == 0.0
