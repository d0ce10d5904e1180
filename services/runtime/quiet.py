"""Quiet by default: the environment every process of a job starts with (the driver, the
actors, a Ray head we start) and the transformers logging of the driver. Standard library
only, so the controller shares it."""

from __future__ import annotations

QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TRANSFORMERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1",
             "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
"""No usage stats, no hub traffic, no progress bars, one OpenMP thread unless a phase
sets its own (services/placement.phase_threads)."""

HEAD_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
"""What a Ray head we start adds: its log monitor looks for new log files every 0.5 s
instead of on each 0.1 s poll (Ray does so itself past 1,000 files), which halves its CPU
(0.93 → 0.46 CPU-s a minute beside 8 idle actors: benchmarks/log_monitor.py); a new
worker's first lines reach the driver up to 0.5 s later."""


def quiet_transformers() -> None:
    """No per-load progress bars or advisory warnings in the driver's log."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
