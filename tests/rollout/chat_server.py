"""Loopback stand-ins for remote endpoints: real HTTP servers on 127.0.0.1 whose answers a
test writes. :class:`ChatHandler` speaks SGLang's OpenAI-compatible
``/v1/chat/completions``; :class:`RewardHandler` a scalar reward endpoint (OpenRLHF's
``remote_rm_url``: ``{"query", "prompts", …}`` in, ``{"rewards": […]}`` out).

A handler may fail before it answers: each entry of its ``failures`` is used by one
request, in arrival order — an HTTP status (503, 429, 401, …) or ``"hang"`` (no answer
for ``hang_s`` seconds: the client's timeout) — and ``fail_always`` fails every request
with that status. Every request is recorded in ``received`` (path, headers, body)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar


class LoopbackHandler(BaseHTTPRequestHandler):
    """POST JSON, get :meth:`reply`'s JSON back, after the failures it is told to give."""

    failures: ClassVar[list[int | str]] = []
    fail_always: ClassVar[int | None] = None
    hang_s: ClassVar[float] = 5.0
    received: ClassVar[list[dict[str, Any]]] = []
    lock: ClassVar[threading.Lock] = threading.Lock()

    def reply(self, body: dict[str, Any]) -> Any:
        raise NotImplementedError  # each test's endpoint says what it answers

    def _failure(self) -> int | str | None:
        cls = type(self)
        with cls.lock:
            if cls.fail_always is not None:
                return cls.fail_always
            return cls.failures.pop(0) if cls.failures else None

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with type(self).lock:
            type(self).received.append({"path": self.path, "headers": dict(self.headers),
                                    "body": body, "at": time.monotonic()})
        failure = self._failure()
        if failure == "hang":
            time.sleep(type(self).hang_s)
        elif failure is not None:
            self.send_error(int(failure))
            return
        data = json.dumps(self.reply(body)).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out first
            pass

    def log_message(self, *args: object) -> None:
        pass


class ChatHandler(LoopbackHandler):
    """POST a chat request, get :meth:`answer`'s text back as the assistant's message."""

    def answer(self, body: dict[str, Any]) -> str:
        raise NotImplementedError  # each test's endpoint says what it answers

    def reply(self, body: dict[str, Any]) -> Any:
        return {"choices": [{"message": {"role": "assistant",
                                         "content": self.answer(body)}}]}


class RewardHandler(LoopbackHandler):
    """POST a batch of samples, get ``{"rewards": [:meth:`reward` of each]}`` back."""

    def reward(self, prompt: str, response: str, label: str | None) -> float:
        raise NotImplementedError  # each test's endpoint says what it answers

    def reply(self, body: dict[str, Any]) -> Any:
        return {"rewards": [self.reward(p, r, lb) for p, r, lb in zip(
            body["prompts"], body["responses"], body["labels"], strict=True)]}


def fresh(handler: type[LoopbackHandler], **state: Any) -> type[LoopbackHandler]:
    """A subclass of ``handler`` with its own record and failures (``state`` overrides
    ``failures``, ``fail_always``, ``hang_s``)."""
    return type(handler.__name__, (handler,), {
        "received": [], "failures": list(state.pop("failures", [])),
        "lock": threading.Lock(), **state})


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """The handler served on a free loopback port: its base URL, stopped after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
