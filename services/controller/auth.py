"""Bearer-token auth of mutating endpoints (only when ``TALLY_API_TOKEN`` is set).

Reads stay open (the dashboard), except what a job wrote in its folder (its logs, events
and samples, which may hold held-out prompts and answers): open to a client on loopback,
from elsewhere only with the API token or that job's own (:func:`require_reader`).
A job the controller submits gets its own token, HMAC(api token, job id): it may post
metrics and status for that job (and read it) and nothing else, and the controller can
recompute it after a restart without storing it. A training
session's token, HMAC(api token, "session:" + id), is made the same way and opens that
session's calls only.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.controller.settings import is_loopback

bearer = HTTPBearer(auto_error=False, description="TALLY_API_TOKEN (or a job's own token)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def own_token(api_token: str, holder: str) -> str:
    """HMAC(api token, ``holder``): a token the controller recomputes, never stores."""
    return hmac.new(api_token.encode(), holder.encode(), hashlib.sha256).hexdigest()


def job_token(api_token: str, job_id: str) -> str:
    return own_token(api_token, f"job:{job_id}")


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


def _api_or_own_token(request: Request, credentials: Credentials, own: str) -> None:
    """The API token, or the token of ``own`` (:func:`own_token`), when an API token is
    configured."""
    expected = _api_token(request)
    if expected is None:
        return
    given = (credentials.credentials if credentials else "").encode()
    mine = own_token(expected, own)
    if not (hmac.compare_digest(given, expected.encode())
            or hmac.compare_digest(given, mine.encode())):
        raise _unauthorized()


def from_loopback(request: Request) -> bool:
    """Whether the client connected from this machine (127.0.0.0/8, ::1). A reverse proxy
    on the same machine is loopback too: it must ask for the token itself."""
    return request.client is not None and is_loopback(request.client.host)


def require_reader(request: Request, credentials: Credentials, own: str) -> None:
    """Loopback: open; elsewhere the API token or the token of ``own`` (``job:<id>``)."""
    if not from_loopback(request):
        _api_or_own_token(request, credentials, own)


def may_read(request: Request, credentials: Credentials, own: str) -> bool:
    """:func:`require_reader` as a yes or no (a route that shows less instead of 401)."""
    try:
        require_reader(request, credentials, own)
    except HTTPException:
        return False
    return True


def require_job_token(job_id: str, request: Request, credentials: Credentials) -> None:
    """The API token, or the token of this one job."""
    _api_or_own_token(request, credentials, f"job:{job_id}")


def session_token(api_token: str, session_id: str) -> str:
    """The token of one training session: its own calls, nothing else."""
    return own_token(api_token, f"session:{session_id}")


def require_session_token(session_id: str, request: Request, credentials: Credentials) -> None:
    """The API token, or the token of this one session."""
    _api_or_own_token(request, credentials, f"session:{session_id}")
