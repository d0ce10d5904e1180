"""Bearer-token auth of mutating endpoints (only when ``TALLY_API_TOKEN`` is set).

Reads stay open (the dashboard). A job the controller submits gets its own token,
HMAC(api token, job id): it may post metrics and status for that job and nothing else,
and the controller can recompute it after a restart without storing it. A training
session's token, HMAC(api token, "session:" + id), is made the same way and opens that
session's calls only.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

bearer = HTTPBearer(auto_error=False, description="TALLY_API_TOKEN (or a job's own token)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def job_token(api_token: str, job_id: str) -> str:
    return hmac.new(api_token.encode(), f"job:{job_id}".encode(), hashlib.sha256).hexdigest()


def _unauthorized() -> HTTPException:
    return HTTPException(401, "a valid bearer token is required (TALLY_API_TOKEN)",
                         headers={"WWW-Authenticate": "Bearer"})


def _api_token(request: Request) -> str | None:
    return request.app.state.controller.settings.api_token


def require_token(request: Request,
                  credentials: Credentials) -> None:
    """The API token, when one is configured."""
    expected = _api_token(request)
    if expected is None:
        return
    given = credentials.credentials if credentials else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise _unauthorized()


def require_job_token(job_id: str, request: Request, credentials: Credentials) -> None:
    """The API token, or the token of this one job."""
    expected = _api_token(request)
    if expected is None:
        return
    given = (credentials.credentials if credentials else "").encode()
    if not (hmac.compare_digest(given, expected.encode())
            or hmac.compare_digest(given, job_token(expected, job_id).encode())):
        raise _unauthorized()


def session_token(api_token: str, session_id: str) -> str:
    """The token of one training session: its own calls, nothing else."""
    return hmac.new(api_token.encode(), f"session:{session_id}".encode(),
                    hashlib.sha256).hexdigest()


def require_session_token(session_id: str, request: Request, credentials: Credentials) -> None:
    """The API token, or the token of this one session."""
    expected = _api_token(request)
    if expected is None:
        return
    given = (credentials.credentials if credentials else "").encode()
    if not (hmac.compare_digest(given, expected.encode())
            or hmac.compare_digest(given, session_token(expected, session_id).encode())):
        raise _unauthorized()
