"""One tokenization for a reward model: for several tokenizers, the ids and score the
reward actor computes (rollout/reward_model.py's ``RewardModel``, the code a job's actor
runs) and train-rm's (services/train_rm/data.py's tokenization, trainer/pair_batch.py's
rows, the rank's decoder + head read at each sequence's last id) equal transformers' own
score of ``apply_chat_template(tokenize=True)`` ids — an
``AutoModelForSequenceClassification`` forward of the ids alone with no pad token in its
config, where transformers reads the last id — to 1e-5.

Tokenizers: (a) the tiny character tokenizer (adds BOS, its template writes BOS), (b) a
Llama-2-chat-like one without a pad token whose template ends the assistant turn with EOS
(built here; its folder's model config has pad = EOS, as train-rm writes it), (c) the
tiny policy's folder, (d) SmolLM2's. The models are small random Qwen2 sequence
classifiers (a Llama one for (b)) over each tokenizer's vocabulary, float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from rollout.preference_pairs import PreferencePair
from rollout.reward_config import RewardModelConfig
from rollout.reward_model import RewardModel
from rollout.tokenizer import CHARACTERS, build_char_tokenizer
from services.train_rm.data import tokenize_pairs
from services.train_rm.run import reward_tokenizer
from tests.reward_model_folders import save_random_reward_model
from trainer.backends.fsdp.reward_model import load_reward_model, token_scores
from trainer.pair_batch import slice_pairs

LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'system' %}<<SYS>>{{ message['content'] }}<</SYS>>"
    "{% else %} {{ message['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
"""Llama-2-chat's shape: BOS written by the template, the assistant turn closed by EOS."""

PAIRS = [
    ("What is 2+2?", "4", "5"),
    ("Tom has 3 apples and eats one. How many are left?", "He has 2 left.", "3"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
     "Blue.", "I like turtles and the sea."),
]


def llama2_like_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level, ``<s>`` prepended on encode, no pad token, Llama-2's template."""
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate([*specials, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = LLAMA2_TEMPLATE
    return tokenizer


def save_llama_reward_model(path: Path, tokenizer: PreTrainedTokenizerFast, seed: int
                             ) -> str:
    """A small random Llama sequence classifier over ``tokenizer``, saved with it; pad =
    EOS in its config, as train-rm writes a folder whose tokenizer has no pad token. (A
    Llama folder: transformers loads the tokenizer as saved, where a Qwen2 folder's
    tokenizer class would add a pad token of its own.)"""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, num_labels=1,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: str,
            smollm2_path: Path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parity")
    build_char_tokenizer().save_pretrained(str(root / "char-tok"))
    return {"char": save_random_reward_model(root / "char", str(root / "char-tok"), seed=11),
            "llama2": save_llama_reward_model(root / "llama2", llama2_like_tokenizer(), 12),
            "policy": save_random_reward_model(root / "policy", tiny_model_path, seed=13),
            "smollm2": save_random_reward_model(root / "smollm2", str(smollm2_path),
                                                seed=14)}


def _messages(prompt: object, response: str) -> list[dict[str, str]]:
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return [*turns, {"role": "assistant", "content": response}]


def transformers_reference(folder: str, prompt: object, response: str
                           ) -> tuple[list[int], float]:
    """transformers alone: ``apply_chat_template(tokenize=True)``'s ids and the one-label
    classifier's forward on them, no pad token in its config (it reads the last id)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoded = tokenizer.apply_chat_template(_messages(prompt, response), tokenize=True)
    ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    model.config.pad_token_id = None
    with torch.no_grad():
        return ids, float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def actor_scores(folder: str, prompts: list, responses: list[str], **settings: object
                 ) -> tuple[list[list[int]], list[float]]:
    """What a job's reward actor computes (its class, built here without Ray)."""
    actor = RewardModel(RewardModelConfig(path=folder, dtype="float32", batch_size=8,
                                          **settings))
    ids, _ = actor.input_ids(prompts, responses)
    scores, _, _ = actor.score(prompts, responses)
    return ids, scores


def train_rm_scores(folder: str, pairs: list[PreferencePair], chat_template: bool,
                    max_length: int = 512) -> tuple[list[list[int]], list[float]]:
    """What train-rm computes: its tokenizer and tokenization, its padded rows, its rank's
    decoder + head read at each sequence's last token (the FSDP wrapping aside)."""
    tokenizer = reward_tokenizer(folder)
    tokenized = tokenize_pairs(pairs, tokenizer, chat_template, max_length)
    batch = tokenized.batch(list(range(len(pairs))), tokenizer.pad_token_id)
    micro = slice_pairs(batch, tuple(range(len(pairs))), packed=False)
    model = load_reward_model(folder, torch.float32, torch.device("cpu"),
                              tokenizer.pad_token_id).eval()
    with torch.no_grad():
        out = token_scores(model, micro.input_ids, micro.position_ids)
    scores = out[micro.score_rows, micro.score_cols, 0].tolist()
    return [ids for pair in tokenized.sequences for ids in pair], scores


@pytest.mark.parametrize("name", ["char", "llama2", "policy", "smollm2"])
def test_actor_train_rm_and_transformers_score_the_same_ids(folders: dict[str, str],
                                                            name: str) -> None:
    folder = folders[name]
    pairs = [PreferencePair(prompt, chosen, rejected) for prompt, chosen, rejected in PAIRS]
    prompts = [p.prompt for p in pairs for _ in range(2)]
    responses = [r for p in pairs for r in (p.chosen, p.rejected)]
    reference = [transformers_reference(folder, p, r)
                 for p, r in zip(prompts, responses, strict=True)]
    ids, scores = actor_scores(folder, prompts, responses, chat_template=True)
    rm_ids, rm_scores = train_rm_scores(folder, pairs, chat_template=True)
    for k, (want_ids, want) in enumerate(reference):
        assert ids[k] == want_ids and rm_ids[k] == want_ids, (name, k)
        assert scores[k] == pytest.approx(want, abs=1e-5), (name, k)
        assert rm_scores[k] == pytest.approx(want, abs=1e-5), (name, k)
    assert len({round(s, 4) for s in scores}) > 1  # the scores tell texts apart
    tokenizer = AutoTokenizer.from_pretrained(folder)
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer.chat_template.startswith("{{ bos_token }}"):
        assert all(row.count(bos) == 1 and row[0] == bos for row in ids), name


def test_the_kinds_are_what_they_claim(folders: dict[str, str]) -> None:
    """(a) adds BOS and templates BOS; (b) has no pad token, pad = EOS in its model's
    config (train-rm's rule), and its ids end with EOS — where transformers' own pad
    search would read one token early, and the actor does not."""
    char = AutoTokenizer.from_pretrained(folders["char"])
    assert char("x")["input_ids"][0] == char.bos_token_id
    llama = AutoTokenizer.from_pretrained(folders["llama2"])
    assert llama.pad_token is None and llama("x")["input_ids"][0] == llama.bos_token_id
    rm_tokenizer = reward_tokenizer(folders["llama2"])
    assert rm_tokenizer.pad_token_id == llama.eos_token_id  # train-rm sets it, as TRL
    model = AutoModelForSequenceClassification.from_pretrained(folders["llama2"])
    assert model.config.pad_token_id == llama.eos_token_id
    ids, want = transformers_reference(folders["llama2"], "2+2?", "4")
    assert ids[-1] == llama.eos_token_id
    with torch.no_grad():
        pad_search = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
    assert abs(pad_search - want) > 1e-3  # the bug the actor's own index avoids
    served = actor_scores(folders["llama2"], ["2+2?"], ["4"], chat_template=True)[1][0]
    assert served == pytest.approx(want, abs=1e-5)


def test_without_a_template_special_tokens_are_added_once(folders: dict[str, str]) -> None:
    """chat_template false: ``tokenizer(prompt + response)``, one BOS, whatever the text
    holds; the actor and train-rm agree, and transformers scores those ids the same."""
    for name in ("char", "llama2", "policy"):
        folder = folders[name]
        tokenizer = AutoTokenizer.from_pretrained(folder)
        want = list(tokenizer("What is 2+2?4")["input_ids"])
        ids, scores = actor_scores(folder, ["What is 2+2?", f"{tokenizer.bos_token}What is 2+2?"],
                                   ["4", "4"], chat_template=False)
        assert ids == [want, want], name
        rm_ids, rm_scores = train_rm_scores(folder, [PreferencePair("What is 2+2?", "4", "5")],
                                            chat_template=False)
        assert rm_ids[0] == want and rm_scores[0] == pytest.approx(scores[0], abs=1e-5)
        assert scores[1] == pytest.approx(scores[0], abs=1e-6)


def test_a_doubled_bos_fails_the_parity_check(folders: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted error: the old tokenization (the template rendered as text, tokenized with
    special tokens added: two BOS) gives other ids and another score than transformers'."""
    import rollout.reward_text as reward_text

    def doubled(tokenizer, messages):  # type: ignore[no-untyped-def]
        return list(tokenizer(tokenizer.apply_chat_template(messages, tokenize=False),
                              add_special_tokens=True)["input_ids"])

    monkeypatch.setattr(reward_text, "_template_ids", doubled)
    folder = folders["char"]
    want_ids, want = transformers_reference(folder, "What is 2+2?", "4")
    ids, (score,) = actor_scores(folder, ["What is 2+2?"], ["4"], chat_template=True)
    assert ids[0][:2] == [want_ids[0]] * 2 and ids[0] != want_ids
    assert score != pytest.approx(want, abs=1e-5)
    with pytest.raises(AssertionError):  # the parity test itself catches it
        test_actor_train_rm_and_transformers_score_the_same_ids(folders, "char")


@pytest.mark.slow  # train-rm's Ray ranks: about 20 s each here
@pytest.mark.parametrize("base", ["tiny", "llama2"])
def test_train_rm_eval_scores_are_the_served_scores(
        ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base: str
) -> None:
    """train-rm (its template, left truncation at 64) writes eval_scores.jsonl; the reward
    actor serving final_model/ with nothing set (its settings from
    tally_reward_model.json) scores the same held-out pairs the same, to 1e-5. Bases: the
    tiny model, and (b), whose tokenizer has no pad token and whose texts end with EOS:
    train-rm saves pad = EOS in the tokenizer and the config together."""
    import json

    from typer.testing import CliRunner

    from rollout.preference_pairs import read_preference_pairs
    from services.cli import app

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    model = "tiny" if base == "tiny" else save_llama_reward_model(
        tmp_path / "base", llama2_like_tokenizer(), seed=21)
    out = tmp_path / "rm"
    result = CliRunner().invoke(app, [
        "train-rm", "configs/rm-tiny.yaml", "--set", "chat_template=true",
        "--set", f"model={model}",
        "--set", "num_steps=2", "--set", "eval_every=0", "--set", "max_length=64",
        "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    trained = [json.loads(line)
               for line in (out / "eval_scores.jsonl").read_text().splitlines()]
    pairs = read_preference_pairs(root / "configs" / "data" / "math-pairs-test.jsonl")
    actor = RewardModel(RewardModelConfig(path=str(out / "final_model"), dtype="float32"))
    assert actor.chat_template and actor.max_length == 64
    prompts = [p.prompt for p in pairs for _ in range(2)]
    responses = [r for p in pairs for r in (p.chosen, p.rejected)]
    ids, over = actor.input_ids(prompts, responses)
    served, _, _ = actor.score(prompts, responses)
    assert over > 0  # some texts were cut, the same way on both sides
    assert all(row[0] == actor.tokenizer.bos_token_id for row in ids if row)
    if base == "llama2":
        eos = actor.tokenizer.eos_token_id
        assert actor.tokenizer.pad_token_id == eos == actor.model.config.pad_token_id
        assert all(row[-1] == eos for row in ids if row)
    for k, scores in enumerate(trained):
        assert served[2 * k] == pytest.approx(scores["chosen"], abs=1e-5), k
        assert served[2 * k + 1] == pytest.approx(scores["rejected"], abs=1e-5), k
