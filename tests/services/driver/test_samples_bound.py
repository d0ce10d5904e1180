"""samples.jsonl stays under logging.samples_max_mb: past it the older training steps are
thinned (every other one of the older half, round by round, the newest never), the
evaluations last; appends stay appends (a rewrite only when the bound is crossed, and
then to ¾ of it); the rewrite goes through a fresh sibling renamed over the file, never
through a link, and a crash in it leaves the old file whole. Held to the rule written
out here (which steps survive a round) and to every row written, kept in order."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollout.sample_record import SampleRecord
from services.controller.job_samples import SampleIndex
from services.driver import samples as samples_module
from services.driver.samples import MIB, THINNED_TO, append_samples, read_samples, thinned

VICTIM_TEXT = "not yours\n"


def _training(step: int, count: int = 4) -> list[SampleRecord]:
    return [SampleRecord(step=step, index=i, group=step * 10 + i // 2, prompt="p" * 40,
                         record_prompt="p", response=f"answer {step}.{i} " + "x" * 150,
                         label="y", reward=0.5, rewards={"rule": 0.5}, response_tokens=3,
                         advantage=0.25) for i in range(count)]


def _evaluation(version: int, count: int = 6) -> list[SampleRecord]:
    return [SampleRecord(step=version, greedy=i == 0, group=i, prompt="q" * 40,
                         record_prompt="q", response=f"eval {version}.{i} " + "z" * 150,
                         label="y", reward=1.0, rewards={"rule": 1.0}, response_tokens=3)
            for i in range(count)]


def _round(steps: list[int]) -> list[int]:
    """The rule, in words: of the n steps present the older ⌊n/2⌋ are thinned, every
    other one dropped from the second on; of one older step, that one goes."""
    older = steps[:len(steps) // 2]
    return older[1::2] if len(older) > 1 else older


def test_the_plan_drops_whole_rounds_older_training_steps_first_and_only_until_it_fits(
        ) -> None:
    sizes = {(False, s): 10 + s for s in range(40)} | {(True, s): 30 for s in range(0, 40, 8)}
    total = sum(sizes.values())
    for bound in range(0, total + 20, 37):
        dropped = thinned(sizes, bound)
        kept = {k: v for k, v in sizes.items() if k not in dropped}
        # replay it round by round: each round's drop is the rule's, and it stops as
        # soon as the bytes fit (the round before did not)
        present = dict(sizes)
        for evaluation in (False, True):
            while sum(present.values()) > bound:
                doomed = _round(sorted(s for e, s in present if e == evaluation))
                if not doomed:
                    break
                for step in doomed:
                    assert (evaluation, step) in dropped
                    del present[(evaluation, step)]
        assert present == kept
        assert (False, 39) in kept and (True, 32) in kept  # the newest never go
        if sum(kept.values()) > bound:  # only when nothing older is left
            assert sorted(kept) == [(False, 39), (True, 32)]
        if any(e for e, _ in dropped):  # evaluations go last: one training step left
            assert [s for e, s in kept if not e] == [39]
    assert thinned(sizes, total) == set()
    assert thinned(sizes, total - 1) == {(False, s) for s in range(1, 20, 2)}


@pytest.mark.parametrize("evaluations", [False, True])
def test_appends_stay_under_the_bound_keep_whole_steps_and_thin_rarely(
        tmp_path: Path, evaluations: bool) -> None:
    path = tmp_path / "samples.jsonl"
    max_mb = 24_000 / MIB  # a few dozen steps
    written: list[dict] = []
    rewrites, inode, appended = 0, None, 0
    for step in range(200):
        batch = _training(step) + (_evaluation(step) if evaluations and step % 10 == 0
                                   else [])
        before = path.stat().st_size if path.exists() else 0
        append_samples(path, batch, max_mb=max_mb)
        written += [r.to_json() for r in batch]
        size = path.stat().st_size
        assert size <= 24_000
        batch_bytes = len("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n"
                                  for r in batch).encode())
        appended += batch_bytes
        if inode is not None and path.stat().st_ino != inode:  # thinned
            assert size <= THINNED_TO * 24_000
            if rewrites:  # a quarter of the bound appended since the last one at least
                assert appended >= (1 - THINNED_TO) * 24_000
            rewrites, appended = rewrites + 1, 0
        else:
            assert size == before + batch_bytes  # an append, nothing rewritten
        inode = path.stat().st_ino
        rows = read_samples(path)
        assert rows == [r for r in written if r in rows]  # what was written, in order
        keys = {(bool(r.get("eval")), r["step"]) for r in rows}
        for evaluation, kept_step in keys:  # a step is kept whole or dropped whole
            assert len([r for r in rows if (bool(r.get("eval")), r["step"]) ==
                        (evaluation, kept_step)]) == (6 if evaluation else 4)
        training = sorted(s for e, s in keys if not e)
        newer = len(training) // 2
        assert training[len(training) - newer:] == list(range(step - newer + 1, step + 1))
    assert rewrites > 5
    training = sorted({r["step"] for r in read_samples(path, evaluation=False)})
    if evaluations:  # they pass the bound alone: thinned too, the newest kept
        assert training == list(range(training[0], 200))  # one left by each thinning
        assert read_samples(path, evaluation=True)[-1]["step"] == 190
    else:  # the oldest step is kept: old steps grow sparse, not gone
        assert training[0] == 0 and len(training) > 6
    assert not list(tmp_path.glob("*.thinning"))


def test_a_rewrite_lands_at_three_quarters_of_the_bound(tmp_path: Path) -> None:
    unbounded, path = tmp_path / "unbounded.jsonl", tmp_path / "samples.jsonl"
    for step in range(10):
        append_samples(unbounded, _training(step))
    bound = unbounded.stat().st_size
    for step in range(10):
        append_samples(path, _training(step), max_mb=bound / MIB)
    assert path.read_bytes() == unbounded.read_bytes()  # at the bound: not thinned
    append_samples(path, _training(10), max_mb=bound / MIB)
    assert path.stat().st_size <= 0.75 * bound  # the documented ¾


def test_evaluations_are_thinned_only_when_training_is_down_to_one_step(tmp_path: Path
                                                                        ) -> None:
    path = tmp_path / "samples.jsonl"
    for version in range(6):
        append_samples(path, _evaluation(version), max_mb=1.0)
    for step in range(4):
        append_samples(path, _training(step, count=1), max_mb=1.0)
    size = path.stat().st_size
    append_samples(path, _training(4, count=1), max_mb=(size - 2000) / MIB)
    assert sorted({r["step"] for r in read_samples(path, evaluation=False)}) == [4]
    versions = sorted({r["step"] for r in read_samples(path, evaluation=True)})
    assert versions[-1] == 5 and len(versions) < 6


def test_the_controllers_index_follows_a_thinned_file(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    index = SampleIndex(path)
    for step in range(30):
        append_samples(path, _training(step), max_mb=12_000 / MIB)
        assert index.refresh()
        rows, _ = index.select(None, None, 1000)
        assert rows == read_samples(path)


def test_thinning_never_writes_through_a_link_and_a_crash_leaves_the_old_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "samples.jsonl"
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    (tmp_path / "samples.jsonl.thinning").symlink_to(victim)
    for step in range(8):
        append_samples(path, _training(step))
    before = path.read_bytes()

    def crash(*_args: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(samples_module.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        append_samples(path, _training(8), max_mb=len(before) / MIB)
    assert victim.read_text() == VICTIM_TEXT
    assert path.read_bytes().startswith(before)  # appended, then not thinned
    monkeypatch.undo()
    append_samples(path, _training(9), max_mb=len(before) / MIB)
    assert victim.read_text() == VICTIM_TEXT
    assert not path.is_symlink() and path.stat().st_size <= len(before)
    assert os.stat(path).st_mode & 0o777 == 0o644


def test_a_torn_line_goes_with_a_thinning(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    append_samples(path, _training(0))
    with path.open("a") as out:
        out.write('{"step": 1, "ind\n')
    for step in range(1, 12):
        append_samples(path, _training(step), max_mb=6000 / MIB)
    assert all(json.loads(line) for line in path.read_text().splitlines())
    assert [r["step"] for r in read_samples(path)][-4:] == [11] * 4
