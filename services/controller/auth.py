"""Bearer-token auth of mutating endpoints (only when ``TALLY_API_TOKEN`` is set).

Reads stay open (the dashboard), except what a job wrote in its folder (its logs, events
and samples, which may hold held-out prompts and answers): open to a client on loopback,
from elsewhere only with the API token or that job's own (:func:`require_reader`).
Every run has its own token, one scheme for every kind (:func:`run_token`):

    token = HMAC-SHA256(api token, "<routes>:" + run id)   (hex)

where ``<routes>`` is ``job`` for the kinds the jobs routes serve (a job, a reward-model
training: it may post metrics and status for that run, and read it) and ``session`` for a
training session (its calls). It opens that one run's routes and nothing else, and the
controller recomputes it after a restart without storing it.
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


ROUTES_OF = {"job": "job", "train_rm": "job", "session": "session"}
"""run kind -> the routes its token opens (the token's prefix)."""


def run_token(api_token: str, kind: str, run_id: str) -> str:
    """The token of one run of ``kind`` (the module doc's formula)."""
    return own_token(api_token, run_holder(kind, run_id))


def run_holder(kind: str, run_id: str) -> str:
    return f"{ROUTES_OF[kind]}:{run_id}"


def job_token(api_token: str, job_id: str) -> str:
    return run_token(api_token, "job", job_id)


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
    _api_or_own_token(request, credentials, run_holder("job", job_id))


def session_token(api_token: str, session_id: str) -> str:
    """The token of one training session: its own calls, nothing else."""
    return run_token(api_token, "session", session_id)


def require_session_token(session_id: str, request: Request, credentials: Credentials) -> None:
    """The API token, or the token of this one session."""
    _api_or_own_token(request, credentials, run_holder("session", session_id))
