"""The training samples a step logs (samples.jsonl): whole groups drawn at random, seeded
by (seed, step), each record's ``index`` its row in the RolloutBatch. Held to the batch
built apart (``build_batch``, what the manager calls) and to the advantages computed here
from the rows' token advantages in float64; the manager's own ``_build_batch`` shows it
passes its seed."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from rollout.advantages import build_estimator
from rollout.batch import RolloutBatch
from rollout.config import AdvantageConfig
from rollout.datasets import PromptRecord
from rollout.engines.base import Generation
from rollout.manager import RolloutManager
from rollout.rollouts.base import Sample
from rollout.rollouts.step import Group, build_batch, groups_of, training_records
from rollout.sample_record import SampleRecord
from services.driver.samples import with_advantages

G = 4
NUM_GROUPS = 6


class Decode:
    """A tokenizer's decode, enough for the records' prompt text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def _groups() -> list[Group]:
    """Groups whose samples are told apart by their text (``g<j>s<k>``)."""
    rng = random.Random(0)
    groups = []
    for j in range(NUM_GROUPS):
        samples = []
        for k in range(G):
            response = [rng.randint(3, 30) for _ in range(rng.randint(1, 5))]
            samples.append(Sample(PromptRecord(f"p{j}", label="x"), [1, 2 + j],
                                  Generation(response, [-0.5] * len(response), "stop"),
                                  float(rng.random()), f"g{j}s{k}", {"rule": 0.5}))
        groups.append(Group(samples))
    return groups


def _chosen(records: list[SampleRecord]) -> dict[int, list[int]]:
    """Group -> the members logged, read from the records' text."""
    out: dict[int, list[int]] = {}
    for record in records:
        j, k = record.response[1:].split("s")
        out.setdefault(int(j), []).append(int(k))
    return out


@pytest.mark.parametrize("limit", [8, 12, 24])
def test_whole_groups_are_drawn_and_the_draw_depends_on_seed_and_step(limit: int) -> None:
    groups = _groups()
    draws = {}
    for step in range(12):
        records = training_records(groups, 0, step, limit, Decode(), seed=7)  # type: ignore[arg-type]
        assert len(records) == limit
        chosen = _chosen(records)
        assert all(members == list(range(G)) for members in chosen.values())  # whole
        assert records == training_records(groups, 0, step, limit, Decode(),  # type: ignore[arg-type]
                                           seed=7)
        draws[step] = sorted(chosen)
    if limit < G * NUM_GROUPS:
        assert len({tuple(d) for d in draws.values()}) > 1  # not the same groups each step
        assert any(d != list(range(limit // G)) for d in draws.values())  # not the first
        others = [sorted(_chosen(training_records(groups, 0, step, limit, Decode(),  # type: ignore[arg-type]
                                                  seed=8))) for step in range(12)]
        assert others != list(draws.values())  # another seed draws others
    else:
        assert all(d == list(range(NUM_GROUPS)) for d in draws.values())


def test_every_group_is_drawn_over_steps() -> None:
    groups = _groups()
    seen: set[int] = set()
    for step in range(50):
        seen |= set(_chosen(training_records(groups, 0, step, G, Decode(), seed=3)))  # type: ignore[arg-type]
    assert seen == set(range(NUM_GROUPS))


def test_only_the_last_group_drawn_is_cut_to_the_limit() -> None:
    groups = _groups()
    for step in range(10):
        records = training_records(groups, 0, step, 10, Decode(), seed=1)  # type: ignore[arg-type]
        members = sorted(len(m) for m in _chosen(records).values())
        assert members == [2, G, G]
        cut = next(j for j, m in _chosen(records).items() if len(m) == 2)
        assert _chosen(records)[cut] == [0, 1]
    few = training_records(groups, 0, 0, 3, Decode(), seed=1)  # type: ignore[arg-type]
    assert [len(m) for m in _chosen(few).values()] == [3]
    assert training_records(groups, 0, 0, 0, Decode(), seed=1) == []  # type: ignore[arg-type]


def _token_advantages(batch: RolloutBatch) -> RolloutBatch:
    """A distinct A_it on every response token of every row."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(batch.advantages.shape, generator=gen)
    return dataclasses.replace(batch, advantages=noise * (batch.loss_mask > 0))


def test_a_record_is_its_batch_row_and_carries_that_rows_advantage() -> None:
    groups = _groups()
    samples = [s for g in groups for s in g.samples]
    first = 40
    for step in range(5):
        records = training_records(groups, first, step, 9, Decode(), seed=11)  # type: ignore[arg-type]
        batch = _token_advantages(build_batch(groups, first, G, 0, {}, [], records))
        logged = with_advantages(batch)
        assert [r.index for r in logged] == sorted(r.index for r in logged)
        for record in logged:
            i = record.index
            assert i is not None
            assert record.response == samples[i].text
            assert record.group == int(batch.group_index[i])
            assert record.prompt == Decode().decode(samples[i].prompt_ids)
            valid = [float(a) for a, m in zip(batch.advantages[i].double().tolist(),
                                              batch.loss_mask[i].tolist(), strict=True) if m]
            assert len(valid) == len(samples[i].generation.token_ids)
            assert record.advantage == pytest.approx(sum(valid) / len(valid), abs=1e-12)


def _manager(seed: int) -> RolloutManager:
    """The manager's state that ``_build_batch`` reads, without its actors."""
    manager = object.__new__(RolloutManager)
    manager.__dict__.update(
        seed=seed, next_group_index=0, samples_per_step=8, tokenizer=Decode(),
        config=SimpleNamespace(n_samples_per_prompt=G), pad_token_id=0, teacher=None,
        estimator_in_driver=False, estimator=build_estimator(AdvantageConfig()))
    return manager


def test_the_manager_draws_with_its_seed() -> None:
    groups = _groups()
    for step in range(4):
        batch = _manager(5)._build_batch(groups, {}, [], step)
        assert batch.samples == training_records(groups, 0, step, 8, Decode(), seed=5)  # type: ignore[arg-type]
    drawn = [[r.index for r in _manager(seed)._build_batch(groups, {}, [], 2).samples]
             for seed in range(6)]
    assert len({tuple(d) for d in drawn}) > 1


def test_groups_of_a_play_keep_their_rows() -> None:
    """The groups the manager passes are ``groups_of`` the played samples: rows in order."""
    played = [s for g in _groups() for s in g.samples]
    records = training_records(groups_of(played, G), 0, 3, 8, Decode(), seed=2)  # type: ignore[arg-type]
    assert [played[r.index].text for r in records if r.index is not None] == \
        [r.response for r in records]
