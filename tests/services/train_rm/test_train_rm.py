"""`tally train-rm`: bad configs and data are refused in one line before anything starts;
the tiny config trains end to end into a folder transformers loads, whose scores are the
ones training computed (one definition of the scored text)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from services.cli import app
from services.config.errors import ConfigError
from services.train_rm.config import load_reward_model_config, parse_reward_model_config

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "rm-tiny.yaml"
runner = CliRunner()


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ray(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a refused run must start nothing")

    monkeypatch.setattr("services.runtime.gang.ensure_ray", no_ray)
    monkeypatch.chdir(ROOT)


def test_shipped_reward_model_configs_are_valid() -> None:
    for path in sorted((ROOT / "configs").glob("rm-*.yaml")):
        config = load_reward_model_config(path)
        assert config.data.test is not None, path
    assert load_reward_model_config(ROOT / "configs" / "rm-math.yaml").chat_template


@pytest.mark.parametrize(("text", "message"), [
    ("trainer: {cp_size: 2}", "trainer.cp_size: train-rm has no context parallelism (got 2)"),
    ("trainer: {lora: {rank: 4}}", "trainer.lora: train-rm trains every weight"),
    ("trainer: {backend: megatron}", "trainer.backend: train-rm runs on fsdp"),
    ("trainer: {loss: {kl_coef: 0.1}}", "trainer.loss: the loss of train-rm is Bradley-Terry"),
    ("trainer: {seed: 1}", "trainer.seed: train-rm has one seed"),
    ("max_length: 4096", "trainer.max_tokens_per_micro_batch: 4096 cannot hold one pair"),
    ("num_steps: 3\nnum_epochs: 1", "num_steps: set num_epochs or num_steps, not both"),
    ("pairs_per_step: 0", "pairs_per_step: Input should be greater than or equal to 1"),
    ("dat: {train: x}", "dat: unknown key; did you mean data?"),
])
def test_bad_configs_are_refused_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_reward_model_config(f"data: {{train: x.jsonl}}\n{text}\n", source="rm.yaml")
    assert str(err.value) == f"rm.yaml: {message}" or str(err.value).startswith(
        f"rm.yaml: {message}"), str(err.value)


def test_a_record_missing_chosen_is_refused_with_its_line(
        tmp_path: Path, nothing_starts: None) -> None:
    pairs = tmp_path / "pairs.jsonl"
    good = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    pairs.write_text("".join(json.dumps(r) + "\n" for r in [good] * 6
                             + [{"prompt": "1+1=", "rejected": "3"}]))
    out = tmp_path / "out"
    result = runner.invoke(app, ["train-rm", str(TINY), "--set", f"data.train={pairs}",
                                 "--output-dir", str(out)])
    assert result.exit_code == 2
    assert result.stderr == f'{pairs} line 7: missing "chosen"\n'
    assert not out.exists()


@pytest.mark.parametrize(("sets", "message"), [
    (["trainer.cp_size=2"], "trainer.cp_size: train-rm has no context parallelism"),
    (["max_length=300", "trainer.max_tokens_per_micro_batch=600"],
     "max_length: 300 is more than the model's context of 256 tokens"),
    (["model=/no/such/model"], "model: '/no/such/model' is neither"),
    (["data.test=nope.jsonl"], "data.test: nope.jsonl: no such file"),
])
def test_the_command_refuses_in_one_line_and_starts_nothing(
        tmp_path: Path, nothing_starts: None, sets: list[str], message: str) -> None:
    out = tmp_path / "out"
    args = [arg for value in sets for arg in ("--set", value)]
    result = runner.invoke(app, ["train-rm", str(TINY), *args, "--output-dir", str(out)])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert message in result.stderr
    assert not out.exists()


def test_a_folder_holding_a_run_is_refused(tmp_path: Path, nothing_starts: None) -> None:
    (tmp_path / "final_model").mkdir()
    result = runner.invoke(app, ["train-rm", str(TINY), "--output-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"{TINY}: output_dir: {tmp_path} already holds a "
                                     "train-rm run; choose another folder or remove it")


@pytest.mark.slow  # Ray actors: 20-30 s here
def test_tiny_reward_model_trains_and_its_folder_scores_what_training_scored(
        ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForSequenceClassification

    from rollout.preference_pairs import read_preference_pairs
    from rollout.reward_text import reward_input_ids
    from rollout.tokenizer import load_tokenizer

    monkeypatch.chdir(ROOT)
    out = tmp_path / "rm"
    data = {}  # the shipped pairs with a margin column (TRL's RewardTrainer's "margin")
    for split in ("train", "test"):
        lines = (ROOT / "configs" / "data" / f"math-pairs-{split}.jsonl").read_text().splitlines()
        rows = [{**json.loads(line), "gap": 0.25 * (i % 3)} for i, line in enumerate(lines)]
        data[split] = tmp_path / f"{split}.jsonl"
        data[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = runner.invoke(app, ["train-rm", str(TINY), "--set", "num_steps=3",
                                 "--set", "eval_every=2", "--output-dir", str(out),
                                 "--set", f"data.train={data['train']}",
                                 "--set", f"data.test={data['test']}",
                                 "--set", "data.margin=gap",
                                 "--set", "center_rewards_coefficient=0.05"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[1].startswith("step 0 (1/3 done) | loss ")
    assert "eval accuracy" in lines[2] and "eval accuracy" in lines[3]  # steps 1 and 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert "eval/accuracy" not in rows[0]["metrics"]
    final = rows[-1]["metrics"]
    for name in ("loss", "accuracy", "margin", "grad_norm", "lr", "perf/pairs_per_s",
                 "perf/tokens_per_s", "eval/loss", "eval/accuracy/no_answer"):
        assert name in final, name
    assert 0 <= final["eval/accuracy"] <= 1

    folder = out / "final_model"
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0
    info = json.loads((folder / "tally_reward_model.json").read_text())
    assert info == {"chat_template": False, "max_length": 256, "base_model": "tiny"}
    tokenizer = load_tokenizer(folder)
    trained = [json.loads(line) for line in (out / "eval_scores.jsonl").read_text().splitlines()]
    pairs = read_preference_pairs(ROOT / "configs" / "data" / "math-pairs-test.jsonl")
    assert len(trained) == len(pairs)
    with torch.no_grad():
        for pair, scores in list(zip(pairs, trained, strict=True))[:12]:
            for side in ("chosen", "rejected"):
                ids = reward_input_ids(tokenizer, pair.prompt, getattr(pair, side), False, 256)
                score = model(input_ids=torch.tensor([ids])).logits[0, 0]
                assert float(score) == pytest.approx(scores[side], abs=1e-5), (pair, side)
    correct = sum(s["chosen"] > s["rejected"] for s in trained) / len(trained)
    assert correct == pytest.approx(final["eval/accuracy"])
    # the held-out loss is TRL's, margins and centring included, over the served scores
    gaps = [0.25 * (i % 3) for i in range(len(trained))]
    bt = sum(-math.log(1 / (1 + math.exp(-(s["chosen"] - s["rejected"] - m))))
             for s, m in zip(trained, gaps, strict=True)) / len(trained)
    centring = sum((s["chosen"] + s["rejected"]) ** 2 for s in trained) / len(trained)
    assert final["eval/loss/bradley_terry"] == pytest.approx(bt, rel=1e-4)
    assert final["eval/loss"] == pytest.approx(bt + 0.05 * centring, rel=1e-4)
    for row in rows:  # training's loss holds both terms too
        metrics = row["metrics"]
        assert metrics["loss"] == pytest.approx(
            metrics["loss/bradley_terry"] + 0.05 * metrics["score/centring"], rel=1e-6)
