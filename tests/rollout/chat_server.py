"""A loopback stand-in for a remote chat endpoint (SGLang's OpenAI-compatible
``/v1/chat/completions``): a real HTTP server on 127.0.0.1 whose answer a test writes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ChatHandler(BaseHTTPRequestHandler):
    """POST a chat request, get :meth:`answer`'s text back as the assistant's message."""

    def answer(self, body: dict[str, Any]) -> str:
        raise NotImplementedError  # each test's endpoint says what it answers

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        data = json.dumps({"choices": [{"message": {
            "role": "assistant", "content": self.answer(body)}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serving(handler: type[ChatHandler]) -> Iterator[str]:
    """The handler served on a free loopback port: its base URL, stopped after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
