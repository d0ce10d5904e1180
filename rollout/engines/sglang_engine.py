"""SGLangEngine: one SGLang server behind its native HTTP API.

    POST /generate  {"input_ids": [[...], ...], "return_logprob": true,
                     "sampling_params": {temperature, top_p, top_k, max_new_tokens,
                                         stop, stop_token_ids[, sampling_seed]}}
        → [{"meta_info": {"output_token_logprobs": [[logprob, token_id, text], ...],
                          "finish_reason": {"type": "stop" | "length" | "abort", ...}}}, ...]
    POST /update_weights_from_disk {"model_path": path, "weight_version": "k"}
        → {"success": bool, "message": str, ...}  (HTTP 400 when it fails)
    GET /model_info → {..., "weight_version": "k"};  GET /health

SGLang reports log-probs of the temperature-scaled distribution, the convention of
engines/base.py (except for top_k = 1, which rollout/config.py refuses). A call's prompts
go out in requests of ``max_batch_size``, all concurrently; SGLang batches them on the GPU.

Per-request seeds (``config.sampling_seed``) take effect only on a server running with
``--enable-deterministic-inference``; sglang_server.launch_command adds it.

A weight update needs no /flush_cache: update_weights_from_disk flushes the prefix cache
itself (its ``flush_cache`` field defaults to true), while a separate /flush_cache is
refused (HTTP 400) whenever a request is queued. The update carries the engine's next
weight version, which the server records; the engine reads it back from /model_info and
fails if the server does not report the version it was sent.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from rollout.config import SamplingConfig, SGLangEngineConfig
from rollout.engines.base import Engine, FinishReason, Generation, as_tensors
from rollout.engines.sglang_server import launch_server, stop_server, wait_healthy
from rollout.tokenizer import eos_token_ids, load_tokenizer


class SGLangError(RuntimeError):
    """The server answered something the engine cannot use."""


def _finish_reason(meta_info: dict[str, Any]) -> FinishReason:
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in ("stop", "length") else "abort"


def parse_generation(item: dict[str, Any]) -> Generation:
    """A Generation from one element of a /generate response."""
    meta_info = item.get("meta_info") or {}
    entries = meta_info.get("output_token_logprobs")
    if entries is None:
        raise SGLangError("generate: response has no meta_info.output_token_logprobs")
    if any(entry[0] is None for entry in entries):
        raise SGLangError("generate: a token came back without its log-prob")
    return Generation(
        token_ids=[int(entry[1]) for entry in entries],
        log_probs=[float(entry[0]) for entry in entries],
        finish_reason=_finish_reason(meta_info),
    )


class SGLangEngine(Engine):
    """Talks to a given URL (config.urls[rank]) or to a server it launches itself."""

    def __init__(
        self,
        config: SGLangEngineConfig,
        model_path: str,
        tokenizer_path: str | None = None,
        rank: int = 0,
    ) -> None:
        self.config = config
        self.model_path = model_path
        self.process: subprocess.Popen | None = None
        if config.urls is not None:
            self.url = config.urls[rank].rstrip("/")
            wait_healthy(self.url, config.launch_timeout_s)
        else:
            self.url, self.process = launch_server(config, model_path, rank)
        self.stop_token_ids = eos_token_ids(load_tokenizer(tokenizer_path or model_path))
        self.weight_version = 0
        self._sync_dir: Path | None = None

    def _sampling_params(self, sampling: SamplingConfig) -> dict[str, Any]:
        return {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang: -1 is off
            "max_new_tokens": sampling.max_new_tokens,
            "stop": list(sampling.stop),
            "stop_token_ids": self.stop_token_ids,
        }

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        params = self._sampling_params(sampling)
        size = self.config.max_batch_size
        payloads = []
        for start in range(0, len(prompt_ids), size):
            chunk = prompt_ids[start : start + size]
            if self.config.sampling_seed:
                chunk_params: Any = [
                    {**params, "sampling_seed": seed + start + i} for i in range(len(chunk))
                ]
            else:
                chunk_params = params
            payloads.append(
                {"input_ids": chunk, "sampling_params": chunk_params, "return_logprob": True}
            )
        responses = asyncio.run(self._post_all("/generate", payloads))
        out = []
        for payload, response in zip(payloads, responses, strict=True):
            items = response if isinstance(response, list) else [response]
            if len(items) != len(payload["input_ids"]):
                raise SGLangError(
                    f"generate: {len(items)} results for {len(payload['input_ids'])} prompts"
                )
            out.extend(parse_generation(item) for item in items)
        return out

    async def _post_all(self, route: str, payloads: list[dict[str, Any]]) -> list[Any]:
        timeout = httpx.Timeout(self.config.request_timeout_s)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout) as client:
            responses = await asyncio.gather(*(client.post(route, json=p) for p in payloads))
        return [self._json(response, route) for response in responses]

    def _json(self, response: httpx.Response, route: str) -> Any:
        if response.status_code != 200:
            raise SGLangError(f"{route}: HTTP {response.status_code}: {response.text[:500]}")
        try:
            return response.json()
        except ValueError as error:
            raise SGLangError(f"{route}: not JSON: {response.text[:500]}") from error

    def _post(self, route: str, payload: dict[str, Any]) -> Any:
        timeout = self.config.request_timeout_s
        return self._json(httpx.post(f"{self.url}{route}", json=payload, timeout=timeout), route)

    def _get(self, route: str) -> Any:
        timeout = self.config.request_timeout_s
        return self._json(httpx.get(f"{self.url}{route}", timeout=timeout), route)

    def served_weight_version(self) -> str | None:
        """The weight version the server reports (GET /model_info)."""
        info = self._get("/model_info")
        version = info.get("weight_version") if isinstance(info, dict) else None
        return None if version is None else str(version)

    def update_weights_from_disk(self, path: str) -> None:
        """Reload the server's weights from a checkpoint directory it can read, tagged with
        the next weight version; the server must then report that version."""
        version = self.weight_version + 1
        payload = {"model_path": path, "weight_version": str(version)}
        result = self._post("/update_weights_from_disk", payload)
        if not isinstance(result, dict) or result.get("success") is not True:
            message = result.get("message", result) if isinstance(result, dict) else result
            raise SGLangError(f"update_weights_from_disk: weight version {version}: {message}")
        served = self.served_weight_version()
        if served != str(version):
            raise SGLangError(
                f"update_weights_from_disk: loaded weight version {version} from {path}, but "
                f"the server reports weight version {served!r}"
            )
        self.weight_version = version

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Write the weights as a checkpoint (the model's config files beside them) and
        have the server load it: a full round trip through disk, simple but not fast."""
        if self._sync_dir is None:
            root = self.config.weight_sync_dir
            if root is not None:
                Path(root).mkdir(parents=True, exist_ok=True)
            self._sync_dir = Path(tempfile.mkdtemp(prefix="tally-weights-", dir=root))
            for file in Path(self.model_path).iterdir():
                if (
                    file.is_file()
                    and file.suffix != ".safetensors"
                    and file.name != "model.safetensors.index.json"
                ):
                    shutil.copy2(file, self._sync_dir / file.name)
        tensors, seen = {}, set()
        for name, tensor in as_tensors(state_dict).items():
            # Tied weights share storage; safetensors refuses aliases, the loader re-ties.
            key = (tensor.data_ptr(), tensor.shape) if tensor.device.type != "meta" else name
            if key not in seen:
                seen.add(key)
                tensors[name] = tensor.detach().to("cpu").contiguous()
        save_file(tensors, str(self._sync_dir / "model.safetensors"))
        self.update_weights_from_disk(str(self._sync_dir))

    def shutdown(self) -> None:
        if self.process is not None:
            stop_server(self.process)
            self.process = None
        if self._sync_dir is not None:
            shutil.rmtree(self._sync_dir, ignore_errors=True)
            self._sync_dir = None
