"""Fixtures of the driver's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B's own folders in tmp_path, none of the caller's W&B environment, and W&B's
    service stopped afterwards (it would idle until the end of the session)."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID",
                 "WANDB_ERROR_REPORTING"):
        monkeypatch.setenv(name, "")  # so that undo removes what the sink sets
        monkeypatch.delenv(name)
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    yield tmp_path
    wandb.teardown()
