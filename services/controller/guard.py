"""Requests a browser could be tricked into sending are refused before any route runs.

- 421: the ``Host`` is not a loopback name, the bind address, the public URL's host or
  one of ``TALLY_ALLOWED_HOSTS`` (DNS rebinding: a foreign name resolving to 127.0.0.1);
- 403: a mutating request (POST/PUT/PATCH/DELETE) from a cross-site ``Origin`` (or with
  ``Sec-Fetch-Site: cross-site``);
- 415: a mutating request whose body is not JSON or YAML (HTML forms send
  ``text/plain``, ``application/x-www-form-urlencoded`` or ``multipart/form-data``, the
  types that need no CORS preflight).

A page on another site can still send a "simple" request, but never with a JSON or YAML
content type (that needs a CORS preflight, which this app never grants) and never
without its ``Origin``; and it cannot read an answer. See docs/controller.md.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from services.controller.settings import LOOPBACK_NAMES, Settings

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
WANTED = frozenset({b"host", b"origin", b"sec-fetch-site", b"content-type", b"content-length",
                    b"transfer-encoding"})
BODY_TYPES = frozenset({"application/json", "application/yaml", "application/x-yaml",
                        "text/yaml", "text/x-yaml"})


def _hostname(netloc: str) -> str:
    """'Example.org:8000' -> 'example.org'; '[::1]:80' -> '::1'."""
    try:
        return (urlsplit(f"//{netloc}").hostname or "").lower()
    except ValueError:
        return ""


def allowed_hosts(settings: Settings) -> frozenset[str]:
    names = {*LOOPBACK_NAMES, "127.0.0.1", "::1", *(h.lower() for h in settings.allowed_hosts)}
    if settings.host not in ("0.0.0.0", "::", ""):
        names.add(settings.host.lower().strip("[]"))
    if settings.public_url:
        names.add(_hostname(urlsplit(settings.public_url).netloc))
    return frozenset(names)


class RequestGuard:
    """ASGI middleware of the three checks above."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.any_host = "*" in settings.allowed_hosts
        self.hosts = allowed_hosts(settings)
        public = urlsplit(settings.public_url) if settings.public_url else None
        self.public_origin = f"{public.scheme}://{public.netloc}".lower() if public else None

    @staticmethod
    async def _refuse(send: Any, status: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _problem(self, scope: dict[str, Any]) -> tuple[int, str] | None:
        headers = {k.decode("latin-1"): v.decode("latin-1")  # ASGI names are lower case
                   for k, v in scope.get("headers", ()) if k in WANTED}
        host = headers.get("host", "")
        if not self.any_host and _hostname(host) not in self.hosts:
            return 421, f"unknown Host {host!r}: add it to TALLY_ALLOWED_HOSTS (or set " \
                        "TALLY_PUBLIC_URL) to serve this name"
        if scope.get("method") not in MUTATING:
            return None
        origin = headers.get("origin")
        if origin is not None:
            same = (origin.lower() in (f"http://{host}".lower(), f"https://{host}".lower(),
                                       self.public_origin))
            if not same:
                return 403, f"cross-site request from Origin {origin!r} refused"
        if headers.get("sec-fetch-site") == "cross-site":
            return 403, "cross-site request refused"
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        if (content_type or has_body) and content_type not in BODY_TYPES:
            return 415, (f"unsupported content type {content_type or '(none)'!r}: send "
                         "application/json or application/yaml")
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            problem = self._problem(scope)
            if problem is not None:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await self._refuse(send, *problem)
                return
        await self.app(scope, receive, send)
