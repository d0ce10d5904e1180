"""A loopback stand-in for an SGLang server, speaking the documented native HTTP shapes.

Generation is a pure function of the prompt: token k of a response to `ids` is
4 + (sum(ids) + k) % 50, with log-prob −0.1·(k+1). A prompt whose sum is even ends
with EOS (id 2) after 3 tokens ("stop"); an odd one runs to max_new_tokens ("length").

Like the real server it answers 400 to a sampling_params key SamplingParams does not
take, records the ``weight_version`` of a weight update only when that update succeeds and
reports it in /model_info. The weight routes follow sglang 0.5.23: a group is made by
/init_weights_update_group; /update_weights_from_distributed and /update_weights_from_tensor
succeed only inside a /begin_weight_update … /end_weight_update session; a failure answers
HTTP 400 {"success": false, "message": …} and leaves the reported version as it was.

Stricter than SGLang: a weight route answers 422 to a key its request struct does not have
(SGLang's HTTP schema ignores unknown keys, so a misspelt field would be dropped silently;
here it fails the test), as FastAPI does to a missing required field or a wrong type.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

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
# The fields of the request structs of the weight routes (python/sglang/srt/managers/
# io_struct.py, sglang 0.5.23; each a BaseReq, which adds rid and http_worker_ipc):
# (every field, the required ones).
_BASE_REQ = frozenset({"rid", "http_worker_ipc"})
WEIGHT_ROUTE_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "/update_weights_from_disk": (_BASE_REQ | {
        "model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
        "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step",
        "flush_cache", "manifest"}, frozenset({"model_path"})),
    "/init_weights_update_group": (_BASE_REQ | {
        "master_address", "master_port", "rank_offset", "world_size", "group_name",
        "backend"}, frozenset({"master_address", "master_port", "rank_offset", "world_size"})),
    "/update_weights_from_distributed": (_BASE_REQ | {
        "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
        "weight_version", "load_format", "selector", "torch_empty_cache"},
        frozenset({"names", "dtypes", "shapes"})),
    "/update_weights_from_tensor": (_BASE_REQ | {
        "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
        "weight_version", "selector", "torch_empty_cache"},
        frozenset({"serialized_named_tensors"})),
    "/begin_weight_update": (_BASE_REQ | {"selector"}, frozenset()),
    "/load_lora_adapter": (_BASE_REQ | {"lora_name", "lora_path", "pinned", "lora_id"},
                           frozenset({"lora_name", "lora_path"})),
    "/unload_lora_adapter": (_BASE_REQ | {"lora_name", "lora_id"}, frozenset({"lora_name"})),
    "/end_weight_update": (_BASE_REQ, frozenset()),
}
PARTIAL_UPDATE_MESSAGE = (
    "Failed to update parameter online: {error}. The full weights of the ModelRunner are "
    "partially updated. Please discard the whole weights.")
"""SGLang's message when loading a received bucket fails (WeightUpdater.
load_weights_from_distributed)."""
INITIAL_WEIGHT_VERSION = "default"
"""ServerArgs.weight_version before any update names one."""


def fake_generation(ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """An even-sum prompt's response ends with EOS as its 3rd token; when that is also the
    last allowed token the finish reason is "length", as SGLang's Req.check_finished
    tests max_new_tokens before EOS."""
    limit = params["max_new_tokens"]
    stops = sum(ids) % 2 == 0 and limit >= 3
    tokens = [4 + (sum(ids) + k) % 50 for k in range(3 if stops else limit)]
    if stops:
        tokens[-1] = EOS
    return {
        "text": "",
        "meta_info": {
            "output_token_logprobs": [[-0.1 * (k + 1), t, None] for k, t in enumerate(tokens)],
            "finish_reason": {"type": "stop", "matched": EOS}
            if stops and limit > 3
            else {"type": "length", "length": limit},
        },
    }


def _failure(message: str) -> tuple[int, Any]:
    return 400, {"success": False, "message": message}


def _refuse_fields(route: str, body: Any) -> tuple[int, Any] | None:
    """422 unless ``body`` is an object of the route's fields, the required ones present,
    weight_version a string (Optional[str] in SGLang)."""
    if not isinstance(body, dict):
        return 422, {"detail": f"{route}: the body must be a JSON object, got {body!r}"}
    allowed, required = WEIGHT_ROUTE_KEYS[route]
    unknown, missing = sorted(set(body) - allowed), sorted(required - set(body))
    if unknown:
        return 422, {"detail": f"{route}: unknown field(s) {unknown}"}
    if missing:
        return 422, {"detail": f"{route}: field(s) required: {missing}"}
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        return 422, {"detail": f"weight_version: expected a string, got {version!r}"}
    return None


class FakeSGLang:
    """Records every request, in order. `fail_updates` makes /update_weights_from_disk
    and /update_weights_from_tensor answer 400; `drop_weight_version` makes disk updates
    succeed without recording the version (a server whose reported version then disagrees
    with the engine's). `fail_bucket = k` makes the k-th /update_weights_from_distributed
    (from 0) of each weight-update session fail as SGLang does when loading a bucket
    fails; `fail_init` (a message) fails /init_weights_update_group."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.fail_updates = False
        self.drop_weight_version = False
        self.fail_bucket: int | None = None
        self.fail_init: str | None = None
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.loaded_files: list[list[str]] = []
        self.groups: dict[str, dict[str, Any]] = {}
        """group name → its /init_weights_update_group request."""
        self.session_open = False
        self.buckets_in_session = 0
        self.lock = threading.Lock()
        self.loras: dict[str, str] = {}
        """Loaded LoRA adapters: name → the folder they were read from."""

    def handle(self, route: str, body: Any) -> tuple[int, Any]:
        with self.lock:
            return self._handle(route, body)

    def _handle(self, route: str, body: Any) -> tuple[int, Any]:
        self.requests.append((route, body))
        if route == "/health":
            return 200, ""
        if route == "/generate":
            return self._generate(body)
        if route in WEIGHT_ROUTE_KEYS:
            refused = _refuse_fields(route, body)
            if refused is not None:
                return refused
        if route == "/update_weights_from_disk":
            return self._update_weights_from_disk(body)
        if route == "/init_weights_update_group":
            return self._init_weights_update_group(body)
        if route == "/begin_weight_update":
            if self.session_open:
                return _failure("a weight-update session is already open; call "
                                "end_weight_update() first")
            self.session_open, self.buckets_in_session = True, 0
            return 200, {"success": True, "message": "Success"}
        if route == "/end_weight_update":
            if not self.session_open:
                return _failure("no weight-update session is open; call "
                                "begin_weight_update() first")
            self.session_open = False
            return 200, {"success": True, "message": "Success"}
        if route == "/update_weights_from_distributed":
            return self._update_weights_from_distributed(body)
        if route == "/update_weights_from_tensor":
            return self._update_weights_from_tensor(body)
        if route == "/load_lora_adapter":
            return self._load_lora_adapter(body)
        if route == "/unload_lora_adapter":
            if self.loras.pop(body["lora_name"], None) is None:
                return 400, {"success": False, "loaded_adapters": self.loras,
                             "error_message": f"{body['lora_name']} is not loaded"}
            return 200, {"success": True, "error_message": None,
                         "loaded_adapters": self.loras}
        if route == "/model_info":
            return 200, {"model_path": "fake", "is_generation": True,
                         "weight_version": self.weight_version}
        if route == "/flush_cache":
            return 200, "Cache flushed."
        return 404, {"error": f"no route {route}"}

    def _load_lora_adapter(self, body: dict[str, Any]) -> tuple[int, Any]:
        """Like SGLang: a peft folder (adapter_config.json, adapter_model.safetensors)."""
        folder = Path(body["lora_path"])
        files = ("adapter_config.json", "adapter_model.safetensors")
        if body["lora_name"] in self.loras or not all((folder / f).is_file() for f in files):
            return 400, {"success": False, "loaded_adapters": self.loras,
                         "error_message": f"cannot load {body['lora_name']} from {folder}"}
        self.loras[body["lora_name"]] = str(folder)
        return 200, {"success": True, "error_message": None, "loaded_adapters": self.loras}

    def _generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        prompts, params = body["input_ids"], body["sampling_params"]
        unknown = {n for n in body.get("lora_path") or [] if n not in self.loras}
        if unknown:
            return 400, {"error": {"message": f"lora_path: {sorted(unknown)} not loaded",
                                   "code": 400}}
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        for p in per_prompt:
            unknown = sorted(set(p) - SAMPLING_PARAMS_KEYS)
            if unknown:
                return 400, {"error": {"message": f"SamplingParams got unexpected keyword "
                                                  f"argument(s) {unknown}", "code": 400}}
        return 200, [fake_generation(i, p) for i, p in zip(prompts, per_prompt, strict=True)]

    def _update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, Any]:
        version = body.get("weight_version")
        if self.fail_updates:
            return 400, {"success": False, "message": "Failed to load weights: bad shape"}
        self.loaded_files.append(sorted(p.name for p in Path(body["model_path"]).iterdir()))
        if version is not None and not self.drop_weight_version:
            self.weight_version = version
        return 200, {"success": True, "message": "Succeeded to update model weights.",
                     "num_paused_requests": 0}

    def _init_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.fail_init is not None:
            return _failure(f"Failed to initialize custom process group: {self.fail_init}.")
        self.groups[body.get("group_name", "weight_update_group")] = body
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def _record_version(self, body: dict[str, Any], message: str) -> tuple[int, Any]:
        version = body.get("weight_version")
        if version is not None:
            self.weight_version = version
            message += f" Weight version updated to {version}."
        return 200, {"success": True, "message": message}

    def _update_weights_from_distributed(self, body: dict[str, Any]) -> tuple[int, Any]:
        if not self.session_open:
            return _failure("update_weights_from_distributed must run between "
                            "begin_weight_update() and end_weight_update()")
        index = self.buckets_in_session
        self.buckets_in_session += 1
        group = body.get("group_name", "weight_update_group")
        if group not in self.groups:
            return _failure(f"Failed to receive weights: Group {group} not in "
                            f"{list(self.groups)}. Please call `init_weights_update_group` "
                            f"first.")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes) or not names:
            return _failure(f"Failed to receive weights: {len(names)} names, {len(dtypes)} "
                            f"dtypes, {len(shapes)} shapes")
        for dtype in dtypes:  # SGLang: getattr(torch, dtype)
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                return _failure(f"Failed to receive weights: module 'torch' has no "
                                f"attribute {dtype!r}")
        if index == self.fail_bucket:
            return _failure(PARTIAL_UPDATE_MESSAGE.format(
                error=f"size mismatch for {names[0]}"))
        return self._record_version(body, "Succeeded to update parameter online.")

    def _update_weights_from_tensor(self, body: dict[str, Any]) -> tuple[int, Any]:
        if not self.session_open:
            return _failure("update_weights_from_tensor must run between "
                            "begin_weight_update() and end_weight_update()")
        payloads = body["serialized_named_tensors"]
        for payload in payloads:  # HTTP callers send base64 (Base64Bytes in SGLang)
            try:
                base64.b64decode(payload, validate=True)
            except (binascii.Error, TypeError, ValueError):
                return 422, {"detail": "serialized_named_tensors: Expected base64-encoded "
                                       "bytes"}
        if self.fail_updates:
            return _failure(f"Failed to update weights: {len(payloads)} payloads")
        return self._record_version(body, "Success")


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
