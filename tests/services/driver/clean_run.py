"""One clean small job that the resume, recovery, fallback and evaluation tests compare
against (the session fixture ``clean_run`` in tests/conftest.py runs it once), and what
they need to compare with it.

The job: 4 rollout steps of 4 prompts × 8 samples, trained in 2 mini-batches × 2 PPO
epochs (4 optimizer steps each), 2 rollouts asked for ahead (so every checkpoint holds
rollouts in flight), a checkpoint after every step, one restart allowed. A constant
schedule: the cosine one depends on num_steps. Nothing a test changes in it
(``checkpoint_every``, ``max_restarts``, ``eval``, a failure, a stop) may change what it
trains: that is what each test shows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[3]
CLEAN = ["num_steps=4", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=8",
         "rollout.global_batch_size=16", "trainer.ppo_epochs=2", "rollout.async_steps=2",
         "trainer.dp_size=2", "trainer.optimizer.lr=2.0e-3",
         "trainer.optimizer.schedule=constant", "checkpoint_every=1", "max_restarts=1"]
NUM_UPDATES = 4
"""Optimizer steps per rollout step: 32 samples / 16 per mini-batch × 2 epochs."""
VARIES = ("perf/", "rollout/gen_", "job/restarts", "env/seconds")
"""Metrics that differ between two runs of the same job: wall-clock times and rates, and
how often it restarted."""


def clean_config(*overrides: str) -> Any:
    """The clean job's config, with ``overrides`` on top."""
    from services.config.job import load_job_config

    return load_job_config(ROOT / "configs" / "demo.yaml", [*CLEAN, *overrides])


@dataclass(frozen=True)
class CleanRun:
    """The clean job's folder (read it, never write it) and what ``run_job`` returned."""

    path: Path
    history: list[dict[str, float]]


def final_weights(job: Path) -> dict[str, torch.Tensor]:
    return load_file(str(job / "final_model" / "model.safetensors"))


def rows(path: Path) -> list[dict]:
    from services.driver.sinks import read_metrics

    return read_metrics(path)


def deterministic(metrics: dict[str, float | None]) -> dict[str, float | None]:
    return {k: v for k, v in metrics.items() if not k.startswith(VARIES)}


def assert_same_training(job: Path, clean: CleanRun, ignore: tuple[str, ...] = ()) -> None:
    """``job`` trained exactly what the clean run did: every metrics.jsonl row (one per
    rollout step, none repeated) and every updates.jsonl row (one per optimizer step)
    hold the same values, bit for bit, and the final weights are the same. ``ignore``:
    metric prefixes the job adds (``eval/``)."""
    for name in ("metrics.jsonl", "updates.jsonl"):
        got, want = rows(job / name), rows(clean.path / name)
        steps = [r["step"] for r in got]
        assert steps == [r["step"] for r in want], (name, steps)
        for g, w in zip(got, want, strict=True):
            g_metrics = {k: v for k, v in deterministic(g["metrics"]).items()
                         if not (ignore and k.startswith(ignore))}
            w_metrics = deterministic(w["metrics"])
            differing = {k: (g_metrics.get(k), w_metrics.get(k))
                         for k in g_metrics.keys() | w_metrics.keys()
                         if g_metrics.get(k) != w_metrics.get(k)}
            assert not differing, (name, g["step"], differing)
    want_weights = final_weights(clean.path)
    got_weights = final_weights(job)
    assert got_weights.keys() == want_weights.keys()
    for name, tensor in got_weights.items():
        torch.testing.assert_close(tensor, want_weights[name], rtol=0, atol=0, msg=name)


class Interrupted(Exception):
    """Stands for a job stopped from outside between two rollout steps."""


def stop_after(last_step: int):
    """An ``after_step`` hook that stops the job once rollout step ``last_step`` (and its
    checkpoint, if due) is done."""

    def hook(step: int, _job: object) -> None:
        if step == last_step:
            raise Interrupted

    return hook


def assert_resumes_exactly(config: Any, tmp_path: Path, stop_at: int = 1) -> Path:
    """Run ``config`` whole, and again stopped after rollout step ``stop_at`` and resumed:
    the resumed run trains bit for bit what the whole one did. Returns the whole run's
    folder. The three runs share one gang (``warm_gangs``): the resumed run on processes
    the whole run used equals it."""
    from services.driver.loop import run_job
    from services.runtime.gang import warm_gangs

    whole = tmp_path / "whole"
    resumed = tmp_path / "resumed"
    with warm_gangs():
        history = run_job(config, whole, log=lambda *_: None)
        with pytest.raises(Interrupted):
            run_job(config, resumed, log=lambda *_: None, after_step=stop_after(stop_at))
        run_job(config, resumed, log=lambda *_: None)
    assert_same_training(resumed, CleanRun(whole, history))
    return whole


def wait_until_dead(call, timeout_s: float = 60.0) -> None:
    """Call ``call()`` (an actor method's ``.remote``) until the actor answers that it is
    dead: ``ray.kill`` returns before the process is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(call(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
    pytest.fail(f"the actor still answers {timeout_s:g} s after it was killed")
