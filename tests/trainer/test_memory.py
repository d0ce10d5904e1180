"""PeakMemory: a block's peak memory, on CPU sampled and caught by the kernel's
high-water mark; the metric names a rank logs per phase."""

from __future__ import annotations

import time

import pytest
import torch

from trainer import memory
from trainer.memory import PeakMemory, phase_metrics

CPU = torch.device("cpu")


def _fresh(fn):
    """Run ``fn`` in a fresh process: resident memory depends on what a process freed
    before (a heap the suite's earlier tests shaped may serve a block from pages it
    holds), and a rank's phase starts from its own history, not the suite's."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn)


def _held_tensor() -> tuple[int, float, float, float]:
    with PeakMemory(CPU) as peak:
        held = torch.ones(75_000_000)  # 300 MB, every page touched
        time.sleep(0.02)
    return held.nbytes, peak.entry_gb, peak.peak_gb, peak.extra_gb


def test_a_tensor_alive_in_the_block_counts() -> None:
    nbytes, entry_gb, peak_gb, extra_gb = _fresh(_held_tensor)
    assert nbytes == 300_000_000
    assert extra_gb >= 0.28, (entry_gb, peak_gb)
    assert peak_gb >= entry_gb + extra_gb - 1e-9


def _nothing() -> tuple[float, float, float]:
    with PeakMemory(CPU) as peak:
        time.sleep(0.02)
    return peak.entry_gb, peak.peak_gb, peak.extra_gb


def test_a_block_allocating_nothing_adds_nothing() -> None:
    entry_gb, peak_gb, extra_gb = _fresh(_nothing)
    assert extra_gb < 0.05, (entry_gb, peak_gb)
    assert peak_gb > 0


@pytest.mark.skipif(not memory.STATUS.exists() or not memory._reset_high_water_mark(),
                    reason="needs Linux's /proc/self/clear_refs to reset VmHWM")
def _short_spike() -> tuple[float, float, float, float]:
    """In a fresh process, whose heap no earlier test has shaped: one sample at entry and
    one at exit only, so the 200 MB that live a few ms in between are seen by VmHWM alone."""
    with PeakMemory(CPU, interval_s=60.0) as peak:
        start = time.perf_counter()
        spike = torch.ones(50_000_000)
        del spike
        lived_s = time.perf_counter() - start
    after_gb, _ = memory._resident_gb()
    return peak.entry_gb, peak.extra_gb, after_gb, lived_s


def test_a_peak_between_two_samples_is_caught_by_the_high_water_mark() -> None:
    entry_gb, extra_gb, after_gb, lived_s = _fresh(_short_spike)
    assert after_gb < entry_gb + 0.05, "the spike was not given back: the exit sample saw it"
    assert lived_s < 1.0
    assert extra_gb >= 0.18, (entry_gb, extra_gb, lived_s)


def test_phase_metrics_names() -> None:
    with PeakMemory(CPU) as peak:
        pass
    assert phase_metrics("sync", peak) == {"perf/peak_mem_gb/sync": peak.peak_gb,
                                           "perf/peak_extra_mem_gb/sync": peak.extra_gb}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_counts_allocated_tensors() -> None:
    device = torch.device("cuda")
    base = torch.empty(10_000_000, device=device)
    with PeakMemory(device) as peak:
        spike = torch.empty(75_000_000, device=device)
        del spike
    assert peak.entry_gb >= 0.04 - 1e-9 and 0.28 <= peak.extra_gb < 0.31, (peak.entry_gb,
                                                                           peak.peak_gb)
    del base
