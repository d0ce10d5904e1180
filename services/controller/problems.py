"""The controller's one 422: every route (and the app's handler of FastAPI's own request
checks) that refuses an input answers ``unprocessable(problems)``, the body of
rollout/problems.py, ``{"detail", "errors": [{"field", "message"}]}`` (``ValidationErrorOut``
in the OpenAPI schema)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rollout.problems import Problem, problems_body
from services.config.errors import error_field

WHOLE_BODY = "<body>"
"""The ``field`` of a problem with the whole request body."""


class Unprocessable(ValueError):
    """A request a route refuses with 422, raised where a helper finds it (a query
    parameter, a row of a batch); the app answers it with :func:`unprocessable`."""

    def __init__(self, problems: Sequence[Problem], detail: str | None = None) -> None:
        self.problems, self.detail = list(problems), detail
        super().__init__(detail or "; ".join(str(p) for p in self.problems))


def unprocessable(problems: Sequence[Problem], detail: str | None = None,
                  prefix: str = "") -> JSONResponse:
    """The 422 answer naming each problem's field; ``detail`` defaults to the problems on
    one line, ``prefix`` goes before it (``config: ``, ``sweep run 'a': ``)."""
    body = problems_body(problems, detail)
    return JSONResponse({**body, "detail": prefix + body["detail"]}, 422)


def request_problems(errors: Iterable[Any]) -> list[Problem]:
    """Pydantic's errors of a request (or a model built from one) as Problems; one with
    no location is the body's."""
    return [Problem(error_field(e.get("loc", ())) or WHOLE_BODY, str(e.get("msg", "")))
            for e in errors]


async def answer_unprocessable(_request: Request, exc: Exception) -> JSONResponse:
    """The app's handler of FastAPI's request checks and of :class:`Unprocessable`."""
    if isinstance(exc, Unprocessable):
        return unprocessable(exc.problems, exc.detail)
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return unprocessable(request_problems(errors), None if errors else "invalid request")
