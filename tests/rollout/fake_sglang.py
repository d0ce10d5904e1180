"""A loopback stand-in for an SGLang server, speaking the documented native HTTP shapes.

Generation is a pure function of the prompt: token k of a response to `ids` is
4 + (sum(ids) + k) % 50, with log-prob −0.1·(k+1). A prompt whose sum is even ends
with EOS (id 2) after 3 tokens ("stop"); an odd one runs to max_new_tokens ("length").

Like the real server it answers 400 to a sampling_params key SamplingParams does not
take, records the ``weight_version`` of a weight update and reports it in /model_info.
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

# The API fields of SGLang's SamplingParams (python/sglang/srt/sampling/sampling_params.py,
# the keyword arguments of SamplingParams(...)); any other key makes /generate answer 400.
SAMPLING_PARAMS_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
})
INITIAL_WEIGHT_VERSION = "default"
"""ServerArgs.weight_version before any update names one."""


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
    """Records every request. `fail_updates` makes weight updates answer 400;
    `drop_weight_version` makes them succeed without recording the version (a server
    whose reported version then disagrees with the engine's)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.fail_updates = False
        self.drop_weight_version = False
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.loaded_files: list[list[str]] = []

    def handle(self, route: str, body: Any) -> tuple[int, Any]:
        self.requests.append((route, body))
        if route == "/health":
            return 200, ""
        if route == "/generate":
            return self._generate(body)
        if route == "/update_weights_from_disk":
            return self._update_weights_from_disk(body)
        if route == "/model_info":
            return 200, {"model_path": "fake", "is_generation": True,
                         "weight_version": self.weight_version}
        if route == "/flush_cache":
            return 200, "Cache flushed."
        return 404, {"error": f"no route {route}"}

    def _generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        prompts, params = body["input_ids"], body["sampling_params"]
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        for p in per_prompt:
            unknown = sorted(set(p) - SAMPLING_PARAMS_KEYS)
            if unknown:
                return 400, {"error": {"message": f"SamplingParams got unexpected keyword "
                                                  f"argument(s) {unknown}", "code": 400}}
        return 200, [fake_generation(i, p) for i, p in zip(prompts, per_prompt, strict=True)]

    def _update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, Any]:
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):  # Optional[str] in SGLang
            return 422, {"detail": f"weight_version: expected a string, got {version!r}"}
        if self.fail_updates:
            return 400, {"success": False, "message": "Failed to load weights: bad shape"}
        self.loaded_files.append(sorted(p.name for p in Path(body["model_path"]).iterdir()))
        if version is not None and not self.drop_weight_version:
            self.weight_version = version
        return 200, {"success": True, "message": "Succeeded to update model weights.",
                     "num_paused_requests": 0}


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
