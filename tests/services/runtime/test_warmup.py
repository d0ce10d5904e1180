"""The warm start's cache: two jobs that start at once with the same warm start train it
once (the second waits on the first's lock and reads its folder)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from rollout.config import SyntheticDatasetConfig
from rollout.tiny import create_tiny_checkpoint
from services.config.job import WarmupConfig
from services.runtime.warmup import warm_start

CONFIG = WarmupConfig(enabled=True, num_steps=3, batch_size=4)


def _start(model: str, cache: str, log_file: str) -> None:
    lines: list[str] = []
    path = warm_start(model, SyntheticDatasetConfig(), CONFIG, Path(cache), lines.append)
    Path(log_file).write_text("\n".join([path, *lines]))


@pytest.mark.slow  # two spawned processes importing torch
def test_two_jobs_starting_together_train_the_warm_start_once(tmp_path: Path) -> None:
    model = create_tiny_checkpoint(tmp_path / "tiny", seed=0)
    spawn = multiprocessing.get_context("spawn")
    logs = [tmp_path / f"job{i}.log" for i in range(2)]
    jobs = [spawn.Process(target=_start, args=(model, str(tmp_path / "cache"), str(log)))
            for log in logs]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=120)
        assert job.exitcode == 0
    said = [log.read_text().splitlines() for log in logs]
    assert said[0][0] == said[1][0]  # one folder
    trained = [lines for lines in said if any(line.startswith("warmup: step") for line in lines)]
    assert len(trained) == 1, said
    (other,) = [lines for lines in said if lines is not trained[0]]
    assert any("cached at" in line for line in other), other
    assert (Path(said[0][0]) / "config.json").is_file()
