"""The driver's metrics files: truncation on resume is atomic and the sink follows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.driver import sinks
from services.driver.sinks import JsonlSink, read_metrics, truncate_after


def steps_in(path: Path) -> list[int]:
    return [row["step"] for row in read_metrics(path)]


def test_truncate_keeps_earlier_steps_and_the_open_sink_writes_to_the_new_file(
        tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path)
    for step in range(5):
        sink.write(step, {"loss": float(step)})
    truncate_after(sink.path, 2)
    sink.write(3, {"loss": 30.0})  # the resumed run repeats step 3
    sink.close()
    assert steps_in(sink.path) == [0, 1, 2, 3]
    assert read_metrics(sink.path)[-1]["metrics"] == {"loss": 30.0}
    assert not list(tmp_path.glob("*.truncating"))


def test_a_crash_while_truncating_leaves_the_old_file_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / sinks.METRICS_FILE
    # a kept row after a dropped one: copied to a sibling renamed over (a tail is cut in place)
    path.write_text("".join(json.dumps({"step": s, "time": 0.0, "metrics": {}}) + "\n"
                            for s in (0, 2, 1, 3)))

    def crash(*_args: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(sinks.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        truncate_after(path, 1)
    assert steps_in(path) == [0, 2, 1, 3]


def test_truncating_a_missing_file_creates_nothing(tmp_path: Path) -> None:
    truncate_after(tmp_path / sinks.METRICS_FILE, 3)
    assert not (tmp_path / sinks.METRICS_FILE).exists()


def test_tensorboard_gets_every_finite_metric_under_its_own_tag_each_step(
        tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = sinks.TensorBoardSink(tmp_path)
    sink.write(0, {"reward/mean": 0.5, "kl": float("nan"), "updates": 1.0})
    sink.write(1, {"reward/mean": 0.75, "kl": 0.25, "updates": 1.0})
    sink.close()
    events = EventAccumulator(str(tmp_path / sinks.TENSORBOARD_DIR), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["kl", "reward/mean", "updates"]
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(0, 0.5), (1, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("kl")] == [(1, 0.25)]  # NaN skipped
