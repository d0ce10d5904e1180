"""A loopback stand-in for an SGLang server, speaking the documented native HTTP shapes.

Generation is a pure function of the prompt: token k of a response to `ids` is
4 + (sum(ids) + k) % 50, with log-prob −0.1·(k+1). A prompt whose sum is even ends
with EOS (id 2) after 3 tokens ("stop"); an odd one runs to max_new_tokens ("length").
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

EOS = 2


def fake_generation(ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    limit = params["max_new_tokens"]
    stops = sum(ids) % 2 == 0 and limit > 3
    tokens = [4 + (sum(ids) + k) % 50 for k in range(3 if stops else limit)]
    if stops:
        tokens[-1] = EOS
    return {
        "text": "",
        "meta_info": {
            "output_token_logprobs": [[-0.1 * (k + 1), t, None] for k, t in enumerate(tokens)],
            "finish_reason": {"type": "stop", "matched": EOS}
            if stops
            else {"type": "length", "length": limit},
        },
    }


class FakeSGLang:
    """Records every request; `fail_updates` makes weight updates answer 400."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.fail_updates = False
        self.loaded_files: list[list[str]] = []

    def handle(self, route: str, body: Any) -> tuple[int, Any]:
        self.requests.append((route, body))
        if route == "/health":
            return 200, ""
        if route == "/generate":
            prompts, params = body["input_ids"], body["sampling_params"]
            per_prompt = params if isinstance(params, list) else [params] * len(prompts)
            return 200, [fake_generation(i, p) for i, p in zip(prompts, per_prompt, strict=True)]
        if route == "/update_weights_from_disk":
            if self.fail_updates:
                return 400, {"success": False, "message": "Failed to load weights: bad shape"}
            self.loaded_files.append(sorted(p.name for p in Path(body["model_path"]).iterdir()))
            return 200, {"success": True, "message": "Succeeded to update model weights."}
        if route == "/flush_cache":
            return 200, "Cache flushed."
        return 404, {"error": f"no route {route}"}


@contextmanager
def serve_fake_sglang() -> Iterator[tuple[str, FakeSGLang]]:
    """(url, fake) of a server on 127.0.0.1 and a free port, shut down afterwards."""
    fake = FakeSGLang()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, route: str, body: Any) -> None:
            status, payload = fake.handle(route, body)
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply(self.path, None)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            self._reply(self.path, json.loads(raw) if raw else None)

        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
