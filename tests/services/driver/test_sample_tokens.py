"""The per-token view of logged samples: the manager's token texts (rollout/
sample_tokens.py) and the driver's numbers (services/driver/sample_tokens.py), on a
multi-turn batch whose logged samples span two of its three groups; the trainer's numbers
are checked against the float64 reference of the whole batch (transformers + softmax)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rollout.batch import RolloutBatch
from rollout.datasets import PromptRecord
from rollout.engines.base import Generation
from rollout.rollouts.base import Sample
from rollout.sample_record import SampleRecord, SampleTokens
from rollout.sample_tokens import response_tokens, token_texts
from rollout.tiny import create_tiny_checkpoint
from rollout.tokenizer import build_char_tokenizer
from services.driver.sample_tokens import logged_samples, with_tokens
from tests.trainer.fsdp.test_token_stats import reference

RESPONSES = ["ab!", "q=7", "hi", "xyz<", "no", "ok?"]
MASKS = [[1, 1, 1], [1, 1, 1], [1, 1], [1, 0, 0, 1], [1, 1], [1, 1, 1]]
"""Sample 3 is an episode: the policy's 'x', the environment's 'yz', the policy's '<'."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def samples() -> list[Sample]:
    tokenizer = build_char_tokenizer()
    out = []
    for k, (text, mask) in enumerate(zip(RESPONSES, MASKS, strict=True)):
        ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        log_probs = [-0.5 - 0.1 * t - k for t in range(len(ids))]
        out.append(Sample(PromptRecord(f"p{k // 2}"), tokenizer.encode(f"p{k // 2}="),
                          Generation(ids, log_probs, "stop"), 1.0, text,
                          mask=[*mask, 1]))
    return out


def batch_of(played: list[Sample]) -> RolloutBatch:
    """Per-token advantages (distinct on every token, nonzero on observations too: the
    driver must zero them), three groups of two; logged: samples 3 and 4 (of groups 1 and
    2: their rows in the trainer's batch are not the batch's)."""
    tokenizer = build_char_tokenizer()
    advantages = [[0.25 * (k + 1) + 0.01 * t for t in range(len(s.generation.token_ids))]
                  for k, s in enumerate(played)]
    records = [SampleRecord(step=0, index=k, group=k // 2, prompt="", record_prompt="",
                            response=played[k].text, label=None, reward=1.0,
                            response_tokens=len(played[k].generation.token_ids),
                            tokens=response_tokens(played[k], tokenizer)) for k in (3, 4)]
    return RolloutBatch.from_samples(
        [s.prompt_ids for s in played], [s.generation.token_ids for s in played],
        [s.generation.log_probs for s in played], [1.0] * 6, advantages,
        [0, 0, 1, 1, 2, 2], 2, response_masks=[s.mask for s in played], samples=records)


class ReferenceTrainer:
    """A TrainerGroup's token_stats as the float64 reference computes it; keeps what
    it was asked."""

    def __init__(self, model_path: str) -> None:
        self.model_path, self.asked = model_path, []

    def token_stats(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.asked.append(batch)
        return reference(self.model_path, batch)


def test_the_manager_decodes_each_token_and_marks_observations() -> None:
    played = samples()
    tokens = response_tokens(played[3], build_char_tokenizer())
    assert tokens.text == ["x", "y", "z", "<", "<eos>"]
    assert tokens.observation == [False, True, True, False, False]
    assert tokens.engine_log_prob == pytest.approx([-3.5, None, None, -3.8, -3.9])
    assert tokens.advantage == [0.0] * 5 and tokens.trainer_log_prob == [None] * 5
    tokenizer = build_char_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<bos>", "A", "\n"])
    assert token_texts(tokenizer, ids) == ["<bos>", "A", "\n"]


def test_the_driver_fills_each_logged_token_from_the_batch_and_the_trainer(
        tiny_model: str) -> None:
    played = samples()
    batch = batch_of(played)
    trainer = ReferenceTrainer(tiny_model)
    records = logged_samples(batch, trainer, sample_tokens=True)
    [asked] = trainer.asked  # one call, on the logged rows alone
    assert asked.input_ids.tolist() == batch.input_ids[[3, 4]].tolist()
    want_log_probs, want_entropy = reference(tiny_model, batch)  # the whole batch's rows
    for record in records:
        i, tokens = record.index, record.tokens
        start, count = int(batch.prompt_lengths[i]), len(played[i].generation.token_ids)
        observation = [not m for m in played[i].mask]
        assert tokens.observation == observation
        assert tokens.text == [*played[i].text, "<eos>"]
        assert tokens.advantage == pytest.approx([
            0.0 if obs else 0.25 * (i + 1) + 0.01 * t for t, obs in enumerate(observation)])
        assert tokens.engine_log_prob == pytest.approx([
            None if obs else lp for obs, lp in zip(observation, played[i].generation.log_probs,
                                                  strict=True)])
        for got, want in ((tokens.trainer_log_prob, want_log_probs),
                          (tokens.entropy, want_entropy)):
            assert [g is None for g in got] == observation
            assert [g for g in got if g is not None] == pytest.approx(
                [float(w) for w, obs in zip(want[i, start:start + count], observation,
                                            strict=True) if not obs], abs=2e-5)
        # the record's advantage (with_advantages: the mean over valid tokens) is theirs
        policy = [a for a, obs in zip(tokens.advantage, observation, strict=True) if not obs]
        assert record.advantage == pytest.approx(sum(policy) / len(policy))
    assert all(math.isfinite(e) and e > 0 for r in records for e in r.tokens.entropy
               if e is not None)


def test_tokens_off_unasked_and_refused_when_the_texts_do_not_fit(tiny_model: str) -> None:
    batch = batch_of(samples())
    trainer = ReferenceTrainer(tiny_model)
    assert [r.tokens for r in logged_samples(batch, trainer, sample_tokens=False)] == [None] * 2
    assert not trainer.asked  # logging.sample_tokens off: no trainer call
    bare = [dataclasses.replace(r, tokens=None) for r in batch.samples]
    assert with_tokens(bare, batch, trainer) == bare and not trainer.asked
    short = dataclasses.replace(batch.samples[0], tokens=SampleTokens(
        ["x"], [False], [0.0], [None], [None], [None]))
    with pytest.raises(ValueError, match="sample 3: 1 token texts for 5 response tokens"):
        with_tokens([short], batch, trainer)
