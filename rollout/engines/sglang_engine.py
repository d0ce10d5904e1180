"""SGLangEngine: one SGLang server behind its native HTTP API (sglang 0.5.23).

    POST /generate  {"input_ids": [[...], ...], "return_logprob": true,
                     "sampling_params": {temperature, top_p, top_k, max_new_tokens,
                                         stop, stop_token_ids[, sampling_seed]}}
        → [{"meta_info": {"output_token_logprobs": [[logprob, token_id, text], ...],
                          "finish_reason": {"type": "stop" | "length" | "abort", ...}}}, ...]
    POST /update_weights_from_disk {"model_path": path, "weight_version": "k"}
        → {"success": bool, "message": str, "num_paused_requests": int}
    POST /init_weights_update_group {"master_address": str, "master_port": int,
                                     "rank_offset": int, "world_size": int,
                                     "group_name": str, "backend": "nccl" | "gloo"}
    POST /begin_weight_update {}   ...   POST /end_weight_update {}
        the session every update_weights_from_distributed / _from_tensor must run in
    POST /update_weights_from_distributed {"names": [...], "dtypes": ["bfloat16", ...],
                                           "shapes": [[...], ...], "group_name": str,
                                           "flush_cache": bool[, "weight_version": "k"]
                                           [, "load_format": "flattened_bucket"]}
    POST /update_weights_from_tensor {"serialized_named_tensors": [base64, one per TP rank],
                                      "flush_cache": bool[, "weight_version": "k"]
                                      [, "load_format": str]}
        → each {"success": bool, "message": str}  (HTTP 400 when success is false)
    POST /load_lora_adapter {"lora_name": str, "lora_path": str}
    POST /unload_lora_adapter {"lora_name": str}
        → each {"success": bool, "error_message": str | None, "loaded_adapters": {...}}
    GET /model_info → {..., "weight_version": "k"};  GET /health

The request fields are those of UpdateWeightFromDiskReqInput, InitWeightsUpdateGroupReqInput,
UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput and
Begin/EndWeightUpdateReqInput in python/sglang/srt/managers/io_struct.py; the routes are in
python/sglang/srt/entrypoints/http_server.py. SGLang ignores a key it does not know, so a
misspelt one would be dropped silently: tests/rollout/fake_sglang.py refuses them.

SGLang reports log-probs of the temperature-scaled distribution, the convention of
engines/base.py (except for top_k = 1, which rollout/config.py refuses). A call's prompts
go out in requests of ``max_batch_size``, all concurrently; SGLang batches them on the GPU.

Per-request seeds (``config.sampling_seed``) take effect only on a server running with
``--enable-deterministic-inference``; sglang_server.launch_command adds it.

A weight update needs no /flush_cache: every update route flushes the prefix cache itself
(``flush_cache`` defaults to true), while a separate /flush_cache is refused (HTTP 400)
whenever a request is queued. An update carries the weight version it loads, which the
server records only when the request succeeds; the engine reads it back from /model_info
and fails if the server does not report the version it was sent.

Weights in buckets (rollout/weight_bucket.py) reach the server one of three ways:

* ``load_weight_buckets``: the buckets written as a sharded safetensors checkpoint
  (``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json``) beside the
  model's config and tokenizer files, then /update_weights_from_disk. Any node, any GPU
  count; the weights go through the disk. SGLang rolls back to the old weights when the
  load fails.
* ``update_weights_from_distributed``: the trainer's rank 0 broadcasts each bucket over a
  process group it shares with the server's GPUs (``init_weights_update_group``;
  trainer/transports/nccl.py is the trainer's side), one POST per bucket.
* ``update_weights_from_tensor``: a server on the trainer's GPUs maps CUDA IPC handles.

A sync of LoRA adapters (trainer.lora; rollout/adapters.py) is written as peft's adapter
folder (B already scaled, so lora_alpha = r) and loaded with /load_lora_adapter under a
name per version; every /generate then names it in ``lora_path`` and the previous
version is unloaded. The server must run with --enable-lora (launch_command adds it).

A failed update_weights_from_distributed or _from_tensor leaves the server's weights
partially updated (SGLang: "The full weights of the ModelRunner are partially updated.
Please discard the whole weights."): from then on ``generate`` refuses until a full
version loads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from rollout.adapters import adapter_factors, is_adapter_sync, write_peft_folder
from rollout.config import SamplingConfig, SGLangEngineConfig
from rollout.engines.base import Engine, EpisodeTurn, FinishReason, Generation, as_tensors
from rollout.engines.sglang_server import launch_server, stop_server, wait_healthy
from rollout.tokenizer import eos_token_ids, load_tokenizer
from rollout.weight_bucket import DTYPES, TensorSpec, WeightBucket, check_buckets, resolve

log = logging.getLogger("tally.rollout")

INDEX_FILE = "model.safetensors.index.json"
"""Hugging Face's index of a sharded safetensors checkpoint: {"metadata": {"total_size":
bytes}, "weight_map": {tensor name: shard file}}."""
FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's load_format for a bucket broadcast as one uint8 buffer (FlattenedTensorBucket,
python/sglang/srt/weight_sync/tensor_bucket.py)."""


def shard_name(index: int, count: int) -> str:
    """Hugging Face's name of shard ``index`` (from 1) of ``count``."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_shards(directory: Path, shards: Iterable[Mapping[str, torch.Tensor]],
                 count: int) -> dict[str, str]:
    """Write ``count`` shards, taking one at a time from ``shards``, and their index;
    first remove every safetensors file or index of a previous version that this one does
    not overwrite. Returns the index's weight map."""
    names = [shard_name(k, count) for k in range(1, count + 1)]
    for file in directory.iterdir():
        if (file.suffix == ".safetensors" and file.name not in names) or file.name == INDEX_FILE:
            file.unlink()
    weight_map: dict[str, str] = {}
    total_size = 0
    for name, tensors in zip(names, shards, strict=True):
        save_file({key: t.contiguous() for key, t in tensors.items()}, str(directory / name),
                  metadata={"format": "pt"})
        for key, tensor in tensors.items():
            weight_map[key] = name
            total_size += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def _check_flat_layout(index: int, specs: Sequence[TensorSpec]) -> None:
    """SGLang's FlattenedTensorBucket.empty lays a received bucket out itself: the tensors
    back to back from byte 0 in the order of ``names``, each at an offset its dtype's
    item size divides. The trainer sends the bucket's own buffer, so its layout must be
    that one."""
    offset = 0
    for spec in specs:
        if spec.offset != offset or offset % DTYPES[spec.dtype].itemsize:
            raise ValueError(
                f"weight bucket {index}: {spec.name} lies at byte {spec.offset}; a flattened "
                f"bucket needs it at byte {offset}, aligned to its dtype")
        offset += spec.num_bytes


class SGLangError(RuntimeError):
    """The server answered something the engine cannot use."""


def _finish_reason(meta_info: dict[str, Any]) -> FinishReason:
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in ("stop", "length") else "abort"


def parse_generation(item: dict[str, Any], eos_ids: Sequence[int] = ()) -> Generation:
    """A Generation from one element of a /generate response. A response whose last token
    is an EOS id ended there ("stop"), whatever the server says: SGLang checks
    max_new_tokens before EOS, so an EOS sampled as the last allowed token comes back as
    "length" — a cut response to the trainer (truncated) and one to continue to a partial
    rollout (rollout/partial.py), where it is neither."""
    meta_info = item.get("meta_info") or {}
    entries = meta_info.get("output_token_logprobs")
    if entries is None:
        raise SGLangError("generate: response has no meta_info.output_token_logprobs")
    if any(entry[0] is None for entry in entries):
        raise SGLangError("generate: a token came back without its log-prob")
    token_ids = [int(entry[1]) for entry in entries]
    finish = _finish_reason(meta_info)
    if finish == "length" and token_ids and token_ids[-1] in eos_ids:
        finish = "stop"
    return Generation(
        token_ids=token_ids,
        log_probs=[float(entry[0]) for entry in entries],
        finish_reason=finish,
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
        self._partial_update: str | None = None
        """Why the server's weights are a mix of two versions (None: they are not)."""
        self.lora_name: str | None = None
        """The loaded LoRA adapter every request names (None: the base weights)."""

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
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int,
        turn: EpisodeTurn | None = None,
    ) -> list[Generation]:
        # ``turn`` needs nothing here: the server's radix cache keeps an episode's prefix.
        if self._partial_update is not None:
            raise SGLangError(f"weights partially updated ({self._partial_update}); the job "
                              f"restarts from its last checkpoint")
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
            payload = {"input_ids": chunk, "sampling_params": chunk_params,
                       "return_logprob": True}
            if self.lora_name is not None:
                payload["lora_path"] = [self.lora_name] * len(chunk)
            payloads.append(payload)
        responses = asyncio.run(self._post_all("/generate", payloads))
        out = []
        for payload, response in zip(payloads, responses, strict=True):
            items = response if isinstance(response, list) else [response]
            if len(items) != len(payload["input_ids"]):
                raise SGLangError(
                    f"generate: {len(items)} results for {len(payload['input_ids'])} prompts"
                )
            out.extend(parse_generation(item, self.stop_token_ids) for item in items)
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

    def _post_update(self, route: str, payload: dict[str, Any]) -> tuple[bool, str]:
        """(success, message) of a weight route: SGLang answers {"success", "message"}, with
        HTTP 400 when success is false; anything else (422: a malformed request, a lost
        connection) is a failure whose message says what came back."""
        try:
            response = httpx.post(f"{self.url}{route}", json=payload,
                                  timeout=self.config.request_timeout_s)
        except httpx.HTTPError as error:
            return False, f"request failed: {type(error).__name__}: {error}"
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code in (200, 400) and isinstance(body, dict) and "success" in body:
            ok = response.status_code == 200 and body["success"] is True
            return ok, str(body.get("message") or body.get("error_message") or "")
        return False, f"HTTP {response.status_code}: {response.text[:500]}"

    def _check_served(self, route: str, version: int) -> None:
        served = self.served_weight_version()
        if served != str(version):
            raise SGLangError(f"{route}: loaded weight version {version}, but the server "
                              f"reports weight version {served!r}")

    def update_weights_from_disk(self, path: str, version: int | None = None) -> None:
        """Reload the server's weights from a checkpoint directory it can read, tagged with
        ``version`` (default: the next one); the server must then report that version.
        SGLang rolls back to the old weights when the load fails."""
        version = self.weight_version + 1 if version is None else version
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
        self._partial_update = None

    def _weights_dir(self) -> Path:
        """The directory the server loads written weights from: made once, with the
        model's config and tokenizer files (everything but its weights) copied in."""
        if self._sync_dir is None:
            root = self.config.weight_sync_dir
            if root is not None:
                Path(root).mkdir(parents=True, exist_ok=True)
            self._sync_dir = Path(tempfile.mkdtemp(prefix="tally-weights-", dir=root))
            for file in Path(self.model_path).iterdir():
                if file.is_file() and file.suffix != ".safetensors" and file.name != INDEX_FILE:
                    shutil.copy2(file, self._sync_dir / file.name)
        return self._sync_dir

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Write the weights as a one-shard checkpoint (the model's config files beside
        them) and have the server load it: a full round trip through disk."""
        tensors, seen = {}, set()
        for name, tensor in as_tensors(state_dict).items():
            # Tied weights share storage; safetensors refuses aliases, the loader re-ties.
            key = (tensor.data_ptr(), tensor.shape) if tensor.device.type != "meta" else name
            if key not in seen:
                seen.add(key)
                tensors[name] = tensor.detach().to("cpu").contiguous()
        directory = self._weights_dir()
        write_shards(directory, [tensors], 1)
        del tensors
        self.update_weights_from_disk(str(directory))

    def load_weight_buckets(self, buckets: Sequence[WeightBucket | Any], version: int) -> None:
        """The object-store path: write the buckets (or Ray object refs of them, mapped in
        place from the node's object store) as the shards of a checkpoint, one bucket per
        shard and one at a time (the views of a bucket's buffer are written straight from
        it, no copy), then have the server load it as weight ``version``.

        A bucket carries each tensor once, a tied head not at all (its sender names each
        parameter once), so no two tensors alias. The buckets are checked (every buffer
        holds its specs, no tensor twice) before any file is written; the names and shapes
        are the server's to check, which rolls back to the old weights if they are wrong."""
        buckets = [bucket for bucket in resolve(buckets) if bucket.specs]  # Ray: for refs
        if not buckets:
            raise ValueError("load_weight_buckets: no tensors in the buckets")
        if is_adapter_sync([spec.name for bucket in buckets for spec in bucket.specs]):
            self.load_adapters(buckets, version)
            return
        check_buckets(buckets, {spec.name: spec.shape for b in buckets for spec in b.specs})
        directory = self._weights_dir()
        write_shards(directory, (bucket.tensors() for bucket in buckets), len(buckets))
        self.update_weights_from_disk(str(directory), version)

    def load_adapters(self, buckets: Sequence[WeightBucket], version: int) -> None:
        """Write one version's adapters as peft's folder, load them under a new name
        (requests name it from then on) and unload the version before."""
        factors = adapter_factors(buckets)
        rank = next(iter(factors.values()))[0].shape[0]
        # Unique per engine: a server given by URL may hold another job's (or an earlier
        # start's) adapters of the same version.
        name = f"tally-{self._weights_dir().name.removeprefix('tally-weights-')}-v{version}"
        # B arrives multiplied by alpha / r: a folder with lora_alpha = r scales it by 1
        folder = write_peft_folder(self._weights_dir() / name, factors, rank=rank,
                                   alpha=float(rank), base_model_path=self.model_path)
        ok, message = self._post_update("/load_lora_adapter", {"lora_name": name,
                                                               "lora_path": str(folder)})
        if not ok:
            shutil.rmtree(folder, ignore_errors=True)
            raise SGLangError(f"load_lora_adapter: weight version {version}: {message}")
        previous, self.lora_name = self.lora_name, name
        self.weight_version = version
        if previous is not None:
            self._unload_adapter(previous)

    def _unload_adapter(self, name: str) -> None:
        """Unload an adapter no request names any more and drop its folder; a failure is
        logged, not raised (the new version is loaded and serving)."""
        ok, message = self._post_update("/unload_lora_adapter", {"lora_name": name})
        if not ok:
            log.warning("sglang.unload_lora_adapter name=%s failed: %s", name, message)
        if self._sync_dir is not None:
            shutil.rmtree(self._sync_dir / name, ignore_errors=True)

    def num_weight_ranks(self) -> int:
        """The ranks this server adds to a weight-update group: its TP GPUs, ranks
        ``rank_offset`` … ``rank_offset + tp_size - 1`` (config.tp_size, which for a server
        given by URL must be the one it runs with)."""
        return self.config.tp_size

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int, group_name: str,
                                  backend: str = "nccl") -> None:
        """Have the server's TP ranks join the process group ``group_name`` whose rank 0,
        the trainer's rank 0, hosts the rendezvous at master_address:master_port
        (trainer/transports/nccl.init_weight_update_group). Blocks until every one of the
        ``world_size`` ranks has joined, so the trainer's side and every other engine's
        call must run meanwhile."""
        payload = {"master_address": master_address, "master_port": master_port,
                   "rank_offset": rank_offset, "world_size": world_size,
                   "group_name": group_name, "backend": backend}
        ok, message = self._post_update("/init_weights_update_group", payload)
        if not ok:
            raise SGLangError(f"init_weights_update_group {group_name!r} at "
                              f"{master_address}:{master_port}: {message}")

    def _begin_weight_update(self) -> None:
        ok, message = self._post_update("/begin_weight_update", {})
        if not ok:  # a session an interrupted update left open: close it, try once more
            self._post_update("/end_weight_update", {})
            ok, message = self._post_update("/begin_weight_update", {})
        if not ok:
            raise SGLangError(f"begin_weight_update: {message}")

    def _in_session(self, route: str, version: int | None,
                    payloads: Sequence[dict[str, Any]]) -> None:
        """Post ``payloads`` to ``route`` in order inside one weight-update session; the
        engine counts as partially updated from the first post until all of them and
        the session's end have succeeded."""
        what = "a weight version" if version is None else f"weight version {version}"
        self._begin_weight_update()
        self._partial_update = f"{what} is being loaded"
        failure: str | None = None
        try:
            for index, payload in enumerate(payloads):
                ok, message = self._post_update(route, payload)
                if not ok:
                    part = f"bucket {index} of {len(payloads)}" if len(payloads) > 1 else "request"
                    failure = f"{route}: {what}, {part} failed: {message}"
                    self._partial_update = f"{part} of {what} failed"
                    raise SGLangError(failure)
        finally:
            ok, message = self._post_update("/end_weight_update", {})
            if not ok and failure is None:
                self._partial_update = f"{what}: end_weight_update failed"
                raise SGLangError(f"end_weight_update: {what}: {message}")
        self._partial_update = None

    def update_weights_from_distributed(self, buckets: Sequence[tuple[TensorSpec, ...]],
                                        version: int, group_name: str,
                                        flattened: bool) -> None:
        """Receive weight ``version`` over the process group ``group_name``: one POST per
        bucket, in order, each answered once the server has received the bucket from the
        group's rank 0 and loaded it. The trainer's rank 0 broadcasts the buckets in the
        same order meanwhile (trainer/transports/nccl.broadcast_bucket):

        * ``flattened``: one broadcast per bucket, a CUDA uint8 tensor of Σ numel·itemsize
          bytes holding the bucket's tensors back to back from byte 0 in the order of its
          names, each the raw bytes of its dtype (SGLang's load_format "flattened_bucket":
          FlattenedTensorBucket.empty allocates that buffer from names/dtypes/shapes and
          views each tensor out of it; WeightBucket.data is that buffer);
        * otherwise one broadcast per tensor, in the order of the names, each a CUDA tensor
          of its dtype and shape (SGLang posts them all as async broadcasts, then waits).

        Only the last bucket carries ``weight_version`` (and ``flush_cache``: one flush of
        the prefix cache for the version), so the server reports the new version only once
        every bucket is in; /model_info must then report it. A failed bucket raises, naming
        it, and leaves the weights partially updated: ``generate`` refuses until a full
        version loads. The whole version runs in one begin/end_weight_update session."""
        if not buckets:
            raise ValueError("update_weights_from_distributed: no buckets")
        for index, specs in enumerate(buckets):
            if not specs:
                raise ValueError(f"weight bucket {index}: empty (SGLang refuses empty buckets)")
            if flattened:
                _check_flat_layout(index, specs)
        payloads: list[dict[str, Any]] = []
        for index, specs in enumerate(buckets):
            last = index == len(buckets) - 1
            payload: dict[str, Any] = {
                "names": [spec.name for spec in specs],
                "dtypes": [spec.dtype for spec in specs],  # torch attribute names
                "shapes": [list(spec.shape) for spec in specs],
                "group_name": group_name,
                "flush_cache": last,
            }
            if flattened:
                payload["load_format"] = FLATTENED_BUCKET
            if last:
                payload["weight_version"] = str(version)
            payloads.append(payload)
        self._in_session("/update_weights_from_distributed", version, payloads)
        self._check_served("update_weights_from_distributed", version)
        self.weight_version = version

    def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str],
                                   version: int | None, load_format: str | None = None
                                   ) -> None:
        """Load a bucket (or all) of the weights from CUDA IPC handles, for a server on the
        trainer's GPUs: one base64 MultiprocessingSerializer payload per TP rank, rank k
        reading entry k (trainer/transports/cuda_ipc.serialize_named_tensors). The tensors
        must stay alive in the sender until this returns.

        ``version`` goes with the last bucket of a version only (None before it): the
        server then flips to it, flushes the prefix cache, and must report it. Until that
        call succeeds the weights are a mix, as after any failure (``generate`` refuses)."""
        if len(serialized_named_tensors) != self.config.tp_size:
            raise ValueError(f"update_weights_from_tensor: {len(serialized_named_tensors)} "
                             f"payloads for a server of {self.config.tp_size} TP ranks")
        payload: dict[str, Any] = {"serialized_named_tensors": list(serialized_named_tensors),
                                   "flush_cache": version is not None}
        if version is not None:
            payload["weight_version"] = str(version)
        if load_format is not None:
            payload["load_format"] = load_format
        self._in_session("/update_weights_from_tensor", version, [payload])
        if version is None:  # more buckets of this version to come
            self._partial_update = "a weight version is being loaded bucket by bucket"
            return
        self._check_served("update_weights_from_tensor", version)
        self.weight_version = version

    def shutdown(self) -> None:
        if self.process is None and self.lora_name is not None:  # a server we do not own
            self._unload_adapter(self.lora_name)
            self.lora_name = None
        if self.process is not None:
            stop_server(self.process)
            self.process = None
        if self._sync_dir is not None:
            shutil.rmtree(self._sync_dir, ignore_errors=True)
            self._sync_dir = None
