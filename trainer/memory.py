"""Peak memory of one phase of a rank (train, sync, checkpoint): ``perf/peak_mem_gb/<phase>``.

In GB (10^9 bytes). CUDA: ``torch.cuda.max_memory_allocated`` since entry — this
process's live tensors on the device, not the caching allocator's reserve, the CUDA
context or other processes (nvidia-smi shows more). CPU: the process's resident
*anonymous* memory (``RssAnon``, /proc/self/status), where CPU tensors, optimizer state
and Python objects live. Memory-mapped files (a checkpoint read through mmap, shared
libraries) and shared memory (Ray's object store in /dev/shm, mapped by ``ray.get``) are
not counted: shared, reclaimable pages that would charge every rank for the whole store.

A thread samples RssAnon every ``interval_s``. A peak shorter than that is caught by the
kernel's exact high-water mark VmHWM, reset at entry by writing "5" to
/proc/self/clear_refs (Linux >= 4.0) and read at exit. VmHWM counts every resident page
(anon + file + shmem), so its anonymous part is taken as VmHWM minus the largest
file + shmem level a sample saw: not above the true anonymous peak while that level moves
slowly (mmaps, the object store), and a short anonymous spike counts whole. The peak is
the larger of that and the largest sample. Where clear_refs is not writable only samples
count; without /proc (macOS) psutil's RSS is sampled.

``extra_gb`` = peak - level at entry: what the phase added. The CUDA peak statistics and
VmHWM are per process: blocks in one process must not nest or overlap.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

import psutil
import torch

GB = 1e9
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_gb() -> dict[str, float]:
    """The ``kB`` fields of /proc/self/status, in GB."""
    fields: dict[str, float] = {}
    for line in STATUS.read_text().splitlines():
        name, _, value = line.partition(":")
        if value.endswith(" kB"):
            fields[name] = int(value[:-3]) * 1024 / GB
    return fields


def _resident_gb() -> tuple[float, float]:
    """(anonymous resident GB, file + shmem resident GB) of this process."""
    if not STATUS.exists():
        return psutil.Process().memory_info().rss / GB, 0.0
    fields = _status_gb()
    if "RssAnon" not in fields:  # Linux < 4.5: all of VmRSS
        return fields["VmRSS"], 0.0
    return fields["RssAnon"], fields["RssFile"] + fields["RssShmem"]


def _reset_high_water_mark() -> bool:
    """VmHWM := the current RSS; False where the kernel or the sandbox does not allow it."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return "VmHWM" in _status_gb()


class PeakMemory:
    """``with PeakMemory(device) as peak: ...``, then ``peak.peak_gb`` and ``peak.extra_gb``."""

    def __init__(self, device: torch.device | str, interval_s: float = 0.005) -> None:
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.entry_gb = self.peak_gb = 0.0
        self._shared_gb = 0.0  # the largest file + shmem level sampled
        self._high_water_mark = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def extra_gb(self) -> float:
        return max(0.0, self.peak_gb - self.entry_gb)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.entry_gb = self.peak_gb = torch.cuda.memory_allocated(self.device) / GB
            return self
        self._high_water_mark = _reset_high_water_mark()
        anon_gb, self._shared_gb = _resident_gb()
        self.entry_gb = self.peak_gb = anon_gb
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        anon_gb, shared_gb = _resident_gb()
        self.peak_gb = max(self.peak_gb, anon_gb)
        self._shared_gb = max(self._shared_gb, shared_gb)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.device.type == "cuda":
            self.peak_gb = torch.cuda.max_memory_allocated(self.device) / GB
            return
        assert self._thread is not None
        self._stop.set()
        self._thread.join()
        self._sample()
        if self._high_water_mark:
            self.peak_gb = max(self.peak_gb, _status_gb()["VmHWM"] - self._shared_gb)


def phase_metrics(phase: str, peak: PeakMemory) -> dict[str, float]:
    """The metrics one rank logs for a phase (``train``, ``sync``, ``checkpoint``)."""
    return {f"perf/peak_mem_gb/{phase}": peak.peak_gb,
            f"perf/peak_extra_mem_gb/{phase}": peak.extra_gb}
