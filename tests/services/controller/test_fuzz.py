"""Schemathesis against the controller's own OpenAPI schema: whatever a client sends,
the answer is never a 5xx (a bounded, derandomized number of examples per operation)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from services.controller.app import create_app  # noqa: E402
from tests.services.controller.fakes import FakeBackend, make_settings  # noqa: E402

# Built at import: schemathesis parametrizes at collection (its fixture-based loader does
# not work with this pytest). The data folder is removed when the test process exits.
_TMP = Path(tempfile.mkdtemp(prefix="tally-fuzz-"))
atexit.register(shutil.rmtree, _TMP, True)
# the event stream follows a live job until it ends: not a request/response operation
schema = schemathesis.openapi.from_asgi(
    "/openapi.json", create_app(make_settings(_TMP), backend=FakeBackend()),
).exclude(path_regex=r"/events$")


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case) -> None:
    case.call_and_validate(checks=[not_a_server_error])
