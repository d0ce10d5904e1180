"""``truncate_after`` on resume (metrics, updates, eval and samples files) reads line by
line and cuts the file in place when the dropped rows are its tail, as they are when rows
are appended in step order. Held to the implementation it replaced (written out here:
the whole file read, its rows of steps ≤ step rewritten) on files with torn lines, blank
lines, evaluation rows written late and steps out of order; its memory to a bound far
under the file's size."""

from __future__ import annotations

import json
import os
import random
import tracemalloc
from pathlib import Path

import pytest

from rollout.sample_record import SampleRecord
from services.driver.checkpoint import truncate_rows_after
from services.driver.run_dir import RunDir
from services.driver.samples import append_samples, read_samples
from services.driver.sinks import JsonlSink, read_metrics, truncate_after


def old_truncate_after(path: Path, step: int) -> None:
    """The implementation before: every row read, those of steps ≤ step written back."""
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(step: int, **extra: object) -> str:
    return json.dumps({"step": step, "time": 0.5, "metrics": {"loss": step / 3}, **extra})


CASES = {
    "in order": [_row(s) for s in range(8)],
    "torn last line": [_row(s) for s in range(6)] + ['{"step": 6, "ti'],
    "torn last line of a kept step": [_row(s) for s in range(3)] + ['{"step": 2, "me'],
    "kept last row without its newline": [_row(s) for s in range(3)] + [_row(1)[:-1] + "}"],
    "blank and garbled lines": [_row(0), "", _row(1), "\x00\x01", _row(2), "not json",
                                _row(5), "\r", _row(6)],
    "evaluations written late": [_row(0), _row(0, eval=True), _row(1), _row(2),
                                 _row(1, eval=True), _row(3), _row(2, eval=True), _row(4)],
    "steps out of order": [_row(s) for s in (0, 3, 1, 4, 2, 7, 5)],
    "a torn line mid-file": [_row(0), _row(1), '{"step": 2, "ti' + _row(2), _row(3)],
    "all dropped": [_row(s) for s in range(5, 9)],
    "empty": [],
}


def _write(path: Path, lines: list[str], trailing_newline: bool) -> None:
    text = "\n".join(lines) + ("\n" if lines and trailing_newline else "")
    path.write_bytes(text.encode("utf-8", "surrogateescape"))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("step", [-1, 0, 1, 2, 4, 9])
def test_it_keeps_what_the_old_implementation_kept(tmp_path: Path, case: str, step: int
                                                   ) -> None:
    trailing = case not in ("torn last line", "torn last line of a kept step",
                            "kept last row without its newline")
    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    _write(new, CASES[case], trailing)
    _write(old, CASES[case], trailing)
    old_truncate_after(old, step)
    truncate_after(new, step)
    assert read_metrics(new) == read_metrics(old)
    assert new.read_bytes() == b"" or new.read_bytes().endswith(b"\n")  # appends start anew
    with new.open("a") as out:
        out.write(_row(99) + "\n")
    assert read_metrics(new) == [*read_metrics(old), json.loads(_row(99))]


def test_a_line_that_is_not_a_row_is_dropped_where_the_old_one_failed(tmp_path: Path
                                                                      ) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [_row(0), "[1, 2]", '{"loss": 1}', '{"step": "3"}', '{"step": true}', _row(1)]
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises((TypeError, KeyError)):
        old_truncate_after(path, 5)
    truncate_after(path, 5)
    assert read_metrics(path) == [json.loads(_row(0)), json.loads(_row(1))]


def test_a_tail_is_cut_in_place_and_kept_lines_keep_their_bytes(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    records = [SampleRecord(step=s, index=i, group=s, prompt="p", record_prompt="p",
                            response="é — \u2028 \x85 ünïcode", label=None, reward=1.0)
               for s in range(5) for i in range(3)]
    append_samples(path, records)
    written = path.read_bytes()
    inode = path.stat().st_ino
    truncate_after(path, 2)
    assert path.stat().st_ino == inode  # cut in place, not rewritten
    kept = b"".join(line for line in written.splitlines(keepends=True)
                    if json.loads(line)["step"] <= 2)
    assert path.read_bytes() == kept
    assert written.startswith(kept)
    assert [row["response"] for row in read_samples(path)] == [records[0].response] * 9


def test_a_kept_row_after_a_dropped_one_rewrites_through_a_fresh_sibling(tmp_path: Path
                                                                         ) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(r + "\n" for r in CASES["evaluations written late"]))
    inode = path.stat().st_ino
    truncate_after(path, 1)
    assert path.stat().st_ino != inode
    assert [(r["step"], r.get("eval", False)) for r in read_metrics(path)] == [
        (0, False), (0, True), (1, False), (1, True)]
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert not list(tmp_path.glob("*.truncating"))


def test_an_open_sink_appends_after_the_cut(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path)
    for step in range(6):
        sink.write(step, {"loss": float(step)})
    truncate_after(sink.path, 2)
    sink.write(3, {"loss": 30.0})
    sink.close()
    assert [r["step"] for r in read_metrics(sink.path)] == [0, 1, 2, 3]


def test_memory_stays_far_under_the_files_size(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    rng = random.Random(0)
    line_bytes = 2000
    with path.open("w") as out:
        for step in range(200):
            for _ in range(20):
                text = "".join(rng.choice("abcdef ") for _ in range(line_bytes))
                out.write(json.dumps({"step": step, "response": text}) + "\n")
    size = path.stat().st_size
    assert size > 8_000_000
    for truncate in (truncate_after, old_truncate_after):
        tracemalloc.start()
        truncate(path, 150 if truncate is truncate_after else 199)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        if truncate is truncate_after:
            assert peak < 200_000, peak  # a few lines, not the file
        else:
            assert peak > size  # the planted whole-file read is seen by the measure
    assert [r["step"] for r in read_metrics(path)][-1] == 150


def test_a_resume_truncates_every_job_file(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    for path, steps in ((run_dir.metrics_file, range(6)), (run_dir.eval_file, range(0, 6, 2)),
                        (run_dir.updates_file, range(12)), (run_dir.samples_file, range(6))):
        path.write_text("".join(_row(s) + "\n" for s in steps))
    truncate_rows_after(run_dir, 2, num_updates_per_rollout=2)
    assert [r["step"] for r in read_metrics(run_dir.metrics_file)] == [0, 1, 2]
    assert [r["step"] for r in read_metrics(run_dir.eval_file)] == [0, 2]
    assert [r["step"] for r in read_metrics(run_dir.updates_file)] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in read_metrics(run_dir.samples_file)] == [0, 1, 2]
