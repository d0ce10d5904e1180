"""SGLangEngine against a loopback fake of SGLang's HTTP API; a real server on GPU."""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollout.config import SamplingConfig, SGLangEngineConfig
from rollout.engines.sglang_engine import INDEX_FILE, SGLangEngine, SGLangError
from rollout.engines.sglang_server import launch_command
from rollout.weight_bucket import TensorSpec, WeightBucket, pack_bucket, plan_buckets
from tests.rollout.fake_sglang import (
    EOS,
    INITIAL_WEIGHT_VERSION,
    WEIGHT_ROUTE_KEYS,
    fake_generation,
    serve_fake_sglang,
)

PROMPTS = [[1, 70, 84], [1, 86, 73, 90], [1, 69], [1, 5, 6, 7], [1, 9]]


def test_generate_parses_tokens_log_probs_and_finish_reasons(tiny_model_path: str) -> None:
    with serve_fake_sglang() as (url, fake):
        config = SGLangEngineConfig(urls=[url], max_batch_size=2)
        engine = SGLangEngine(config, tiny_model_path)
        sampling = SamplingConfig(
            temperature=0.8, top_p=0.9, top_k=0, max_new_tokens=5, stop=["\n"]
        )
        generations = engine.generate(PROMPTS, sampling, seed=0)

    expected = [fake_generation(p, {"max_new_tokens": 5})["meta_info"] for p in PROMPTS]
    for gen, meta in zip(generations, expected, strict=True):  # in prompt order
        assert gen.token_ids == [t for _, t, _ in meta["output_token_logprobs"]]
        assert gen.log_probs == [lp for lp, _, _ in meta["output_token_logprobs"]]
        assert gen.finish_reason == meta["finish_reason"]["type"]
    assert {g.finish_reason for g in generations} == {"stop", "length"}
    assert generations[2].token_ids[-1] == EOS  # sum([1, 69]) is even: stops

    posts = [body for route, body in fake.requests if route == "/generate"]
    # max_batch_size chunks, sent concurrently (so they may arrive in any order)
    assert sorted(len(body["input_ids"]) for body in posts) == [1, 2, 2]
    assert posts[0]["return_logprob"] is True
    assert posts[0]["sampling_params"] == {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": -1,  # our 0 ("off") is SGLang's -1
        "max_new_tokens": 5,
        "stop": ["\n"],
        "stop_token_ids": [EOS],
    }


def test_per_request_seeds_when_enabled(tiny_model_path: str) -> None:
    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url], sampling_seed=True), tiny_model_path)
        engine.generate(PROMPTS[:3], SamplingConfig(max_new_tokens=2), seed=100)
    (body,) = [body for route, body in fake.requests if route == "/generate"]
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [100, 101, 102]


def test_fake_refuses_unknown_sampling_params_like_sglang() -> None:
    with serve_fake_sglang() as (url, _):
        body = {"input_ids": [[1, 2]], "return_logprob": True}
        bad = httpx.post(f"{url}/generate", json={
            **body, "sampling_params": {"max_new_tokens": 2, "temprature": 0.5}})
        assert bad.status_code == 400 and "temprature" in bad.text
        bad_one_of_list = httpx.post(f"{url}/generate", json={
            **body, "input_ids": [[1], [2]],
            "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 2, "seed": 1}]})
        assert bad_one_of_list.status_code == 400 and "'seed'" in bad_one_of_list.text
        good = httpx.post(f"{url}/generate", json={
            **body, "sampling_params": {"max_new_tokens": 2, "sampling_seed": 3}})
        assert good.status_code == 200


def test_weight_updates_go_through_disk(tiny_model_path: str) -> None:
    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url]), tiny_model_path)
        assert engine.served_weight_version() == INITIAL_WEIGHT_VERSION
        engine.update_weights_from_disk(tiny_model_path)
        state = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
        engine.update_weights(state)  # tied lm_head/embeddings: saved once
        updates = [body for route, body in fake.requests if route == "/update_weights_from_disk"]
        # The update flushes the cache itself; a separate /flush_cache would answer 400
        # while anything is queued.
        assert "/flush_cache" not in [route for route, _ in fake.requests]
        assert [u["weight_version"] for u in updates] == ["1", "2"]
        assert fake.weight_version == "2" and engine.weight_version == 2
        # One shard and its index, in Hugging Face's layout.
        assert {"model-00001-of-00001.safetensors", INDEX_FILE} <= set(fake.loaded_files[1])
        assert "config.json" in fake.loaded_files[1] and "tokenizer.json" in fake.loaded_files[1]
        fake.fail_updates = True
        with pytest.raises(SGLangError, match=r"update_weights_from_disk: HTTP 400: .*bad shape"):
            engine.update_weights_from_disk(tiny_model_path)
        assert engine.weight_version == 2
        engine.shutdown()


def test_weight_update_fails_when_the_server_reports_another_version(
    tiny_model_path: str,
) -> None:
    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url]), tiny_model_path)
        fake.drop_weight_version = True
        with pytest.raises(
            SGLangError, match=r"loaded weight version 1 .* reports weight version 'default'"
        ):
            engine.update_weights_from_disk(tiny_model_path)
        assert engine.weight_version == 0  # not counted: the server did not confirm it


def test_launch_command() -> None:
    config = SGLangEngineConfig(
        base_port=31000, tp_size=2, mem_fraction_static=0.7, extra_args=["--dtype", "bfloat16"]
    )
    command = launch_command(config, "/models/m", port=31001)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    assert command[3:] == [
        "--model-path",
        "/models/m",
        "--host",
        "127.0.0.1",
        "--port",
        "31001",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.7",
        "--dtype",
        "bfloat16",
    ]
    assert "--enable-deterministic-inference" not in command


def test_launch_command_seeded_sampling_is_deterministic_inference() -> None:
    """SGLang ignores sampling_seed unless the server runs with this flag."""
    command = launch_command(SGLangEngineConfig(sampling_seed=True), "/models/m", port=1)
    assert command.count("--enable-deterministic-inference") == 1
    given = SGLangEngineConfig(sampling_seed=True, extra_args=["--enable-deterministic-inference"])
    assert launch_command(given, "/models/m", port=1).count("--enable-deterministic-inference") == 1


# The char tokenizer is ours, not one SGLang knows: ids in, ids out. Head dim 16 is below
# what the fused attention kernels take, so use the plain torch backend.
TINY_SERVER_ARGS = ["--dtype", "float32", "--skip-tokenizer-init",
                    "--cuda-graph-backend-decode", "disabled",
                    "--cuda-graph-backend-prefill", "disabled",
                    "--attention-backend", "torch_native"]


def _needs_real_sglang() -> None:
    if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
        pytest.skip("needs the sglang package and a CUDA GPU")


def _assert_teacher_forced(model: torch.nn.Module, generations: list) -> None:
    """Each generation's log-probs are ``model``'s, teacher-forced on its tokens."""
    for prompt, gen in zip(PROMPTS, generations, strict=True):
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(gen.token_ids)[:, None])
        assert torch.allclose(torch.tensor(gen.log_probs), expected.squeeze(-1), atol=1e-3)


@pytest.mark.gpu
def test_real_sglang_server_log_probs(tiny_model_path: str) -> None:
    """A launched SGLang server on the tiny model: log-probs match a teacher-forced pass."""
    _needs_real_sglang()
    config = SGLangEngineConfig(base_port=31500, mem_fraction_static=0.3,
                                extra_args=TINY_SERVER_ARGS)
    engine = SGLangEngine(config, tiny_model_path)
    try:
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
        generations = engine.generate(PROMPTS, sampling, seed=0)
        _assert_teacher_forced(AutoModelForCausalLM.from_pretrained(tiny_model_path).eval(),
                               generations)
        engine.update_weights_from_disk(tiny_model_path)
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_real_sglang_server_serves_a_synced_adapter(tiny_model_path: str) -> None:
    """A launched server with LoRA serving: after an adapter sync its log-probs are those
    of the base with W + B·A (B sent scaled), teacher-forced."""
    _needs_real_sglang()
    config = SGLangEngineConfig(base_port=31600, mem_fraction_static=0.3, max_lora_rank=4,
                                lora_target_modules=["q_proj", "v_proj"],
                                extra_args=TINY_SERVER_ARGS)
    buckets = _adapter_buckets(tiny_model_path, rank=4, seed=0)
    engine = SGLangEngine(config, tiny_model_path)
    try:
        engine.load_weight_buckets(buckets, version=1)
        generations = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=8), seed=0)
        from rollout.adapters import adapter_factors

        model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
        modules = dict(model.named_modules())
        with torch.no_grad():
            for module, (a, b) in adapter_factors(buckets).items():
                modules[module].weight += b @ a
        _assert_teacher_forced(model, generations)
    finally:
        engine.shutdown()


# ---- weights in buckets -------------------------------------------------------------------

GROUP = "tally-weights"


def _parameters(path: str) -> dict[str, torch.Tensor]:
    """Each parameter once (the tied head is the embedding), as a trainer sends them."""
    model = AutoModelForCausalLM.from_pretrained(path)
    return {name: p.detach() for name, p in model.named_parameters()}


def _plan(state: dict[str, torch.Tensor], dtype: str, num_buckets: int
          ) -> list[tuple[TensorSpec, ...]]:
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    total = sum(t.numel() for t in state.values()) * size
    return plan_buckets([(n, tuple(t.shape)) for n, t in state.items()], dtype,
                        total // num_buckets + 1)


def _routes(fake: object) -> list[str]:
    return [route for route, _ in fake.requests]  # type: ignore[attr-defined]


def test_init_weights_update_group_sends_sglangs_fields(tiny_model_path: str) -> None:
    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url], tp_size=2), tiny_model_path)
        assert engine.num_weight_ranks() == 2
        engine.init_weights_update_group("10.0.0.1", 29600, 1, 3, GROUP)
        # Exactly InitWeightsUpdateGroupReqInput's fields (the fake refuses any other).
        assert fake.groups[GROUP] == {
            "master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1,
            "world_size": 3, "group_name": GROUP, "backend": "nccl"}
        fake.fail_init = "connection refused"
        with pytest.raises(SGLangError, match=r"init_weights_update_group 'g2' .*connection "
                                              r"refused"):
            engine.init_weights_update_group("10.0.0.1", 29601, 1, 3, "g2", backend="gloo")


@pytest.mark.parametrize("flattened", [True, False])
def test_buckets_over_a_group_in_order_the_version_on_the_last(
        tiny_model_path: str, flattened: bool) -> None:
    state = _parameters(tiny_model_path)
    buckets = _plan(state, "bfloat16", 3)
    assert len(buckets) >= 3
    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url]), tiny_model_path)
        engine.init_weights_update_group("127.0.0.1", 29600, 1, 2, GROUP)
        del fake.requests[:]
        engine.update_weights_from_distributed(buckets, 7, GROUP, flattened)
        routes = _routes(fake)
        assert routes == (["/begin_weight_update"]
                          + ["/update_weights_from_distributed"] * len(buckets)
                          + ["/end_weight_update", "/model_info"])
        posts = [body for route, body in fake.requests
                 if route == "/update_weights_from_distributed"]
        for index, (specs, body) in enumerate(zip(buckets, posts, strict=True)):
            last = index == len(buckets) - 1
            assert body["names"] == [spec.name for spec in specs]
            assert body["dtypes"] == ["bfloat16"] * len(specs)
            assert body["shapes"] == [list(state[spec.name].shape) for spec in specs]
            assert body["group_name"] == GROUP
            assert body["flush_cache"] is last  # one flush, once the version is in
            assert body.get("weight_version") == ("7" if last else None)
            assert body.get("load_format") == ("flattened_bucket" if flattened else None)
        assert [n for body in posts for n in body["names"]] == list(state)  # all, once
        assert fake.weight_version == "7" and engine.weight_version == 7
        assert not fake.session_open
        engine.generate([[1, 2]], SamplingConfig(max_new_tokens=2), seed=0)


def test_a_failed_bucket_keeps_the_old_version_and_stops_generation(
        tiny_model_path: str) -> None:
    state = _parameters(tiny_model_path)
    buckets = _plan(state, "float32", 3)
    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url]), tiny_model_path)
        engine.init_weights_update_group("127.0.0.1", 29600, 1, 2, GROUP)
        engine.update_weights_from_distributed(buckets, 1, GROUP, flattened=True)
        fake.fail_bucket = 1
        with pytest.raises(SGLangError, match=(
                rf"weight version 2, bucket 1 of {len(buckets)} failed: Failed to update "
                r"parameter online: size mismatch .*partially updated")):
            engine.update_weights_from_distributed(buckets, 2, GROUP, flattened=True)
        # Bucket 2 was never sent, the session was closed, the server kept its version.
        posts = [b for r, b in fake.requests if r == "/update_weights_from_distributed"]
        assert len(posts) == len(buckets) + 2
        assert _routes(fake)[-1] == "/end_weight_update" and not fake.session_open
        assert engine.served_weight_version() == "1" and engine.weight_version == 1
        with pytest.raises(SGLangError, match=r"weights partially updated \(bucket 1 of \d "
                                              r"of weight version 2 failed\); the job restarts "
                                              r"from its last checkpoint"):
            engine.generate([[1, 2]], SamplingConfig(max_new_tokens=2), seed=0)
        assert "/generate" not in _routes(fake)
        # A full version (here from the object store, through disk) lifts it.
        engine.load_weight_buckets([pack_bucket(specs, state) for specs in buckets], 3)
        assert engine.served_weight_version() == "3"
        engine.generate([[1, 2]], SamplingConfig(max_new_tokens=2), seed=0)


def test_the_fake_refuses_what_sglang_would_drop(tiny_model_path: str) -> None:
    """A misspelt field must fail a test: SGLang itself would ignore it."""
    with serve_fake_sglang() as (url, fake):
        good = {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2]],
                "group_name": GROUP, "flush_cache": True, "weight_version": "1"}
        for route, body in [
            ("/update_weights_from_distributed", {**good, "weight_versoin": "1"}),
            ("/update_weights_from_distributed", {k: v for k, v in good.items()
                                                  if k != "shapes"}),
            ("/init_weights_update_group", {"master_address": "h", "master_port": 1,
                                            "rank_offset": 1, "world_size": 2,
                                            "group": GROUP}),
            ("/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="],
                                             "flush_cache": True, "version": "1"}),
            ("/update_weights_from_disk", {"model_path": "/m", "weight_version": 1}),
            ("/begin_weight_update", {"flush": True}),
        ]:
            answer = httpx.post(f"{url}{route}", json=body)
            assert answer.status_code == 422, (route, answer.text)
        assert set(WEIGHT_ROUTE_KEYS["/update_weights_from_distributed"][0]) >= set(good)
        # Outside a begin/end session SGLang 0.5.23 refuses to load; dtypes are torch names.
        outside = httpx.post(f"{url}/update_weights_from_distributed", json=good)
        assert outside.status_code == 400 and "begin_weight_update" in outside.text
        engine = SGLangEngine(SGLangEngineConfig(urls=[url]), tiny_model_path)
        with pytest.raises(SGLangError, match=r"Group tally-weights not in \[\]"):
            engine.update_weights_from_distributed([(TensorSpec("a", (2,), "bfloat16"),)], 1,
                                                   GROUP, flattened=False)
        assert fake.weight_version == INITIAL_WEIGHT_VERSION


def test_a_flattened_bucket_must_be_laid_out_as_sglang_lays_it(tiny_model_path: str) -> None:
    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url]), tiny_model_path)
        gap = (TensorSpec("a", (2,), "float32", 0), TensorSpec("b", (2,), "float32", 16))
        with pytest.raises(ValueError, match=r"bucket 0: b lies at byte 16; .* byte 8"):
            engine.update_weights_from_distributed([gap], 1, GROUP, flattened=True)
        with pytest.raises(ValueError, match="empty"):
            engine.update_weights_from_distributed([()], 1, GROUP, flattened=False)
        assert fake.requests == [("/health", None)]


def test_update_weights_from_tensor_one_payload_per_tp_rank(tiny_model_path: str) -> None:
    payloads = [base64.b64encode(f"rank {k}".encode()).decode() for k in range(2)]
    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url], tp_size=2), tiny_model_path)
        # A version bucket by bucket: the first ones carry no version and flush nothing.
        engine.update_weights_from_tensor(payloads, None)
        assert fake.weight_version == INITIAL_WEIGHT_VERSION and engine.weight_version == 0
        with pytest.raises(SGLangError, match="weights partially updated"):
            engine.generate([[1]], SamplingConfig(max_new_tokens=1), seed=0)
        engine.update_weights_from_tensor(payloads, 5)
        first, last = [b for r, b in fake.requests if r == "/update_weights_from_tensor"]
        assert first == {"serialized_named_tensors": payloads, "flush_cache": False}
        assert last == {"serialized_named_tensors": payloads, "flush_cache": True,
                        "weight_version": "5"}
        assert _routes(fake)[-4:] == ["/begin_weight_update", "/update_weights_from_tensor",
                                      "/end_weight_update", "/model_info"]
        assert engine.weight_version == 5 and fake.weight_version == "5"
        engine.generate([[1]], SamplingConfig(max_new_tokens=1), seed=0)
        with pytest.raises(ValueError, match="1 payloads for a server of 2 TP ranks"):
            engine.update_weights_from_tensor(payloads[:1], 6)
        fake.fail_updates = True
        with pytest.raises(SGLangError, match=r"weight version 6, request failed"):
            engine.update_weights_from_tensor(payloads, 6, load_format="direct")
        assert fake.weight_version == "5" and not fake.session_open
        with pytest.raises(SGLangError, match="weights partially updated"):
            engine.generate([[1]], SamplingConfig(max_new_tokens=1), seed=0)


def _shards(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.safetensors"))


def test_load_weight_buckets_writes_a_sharded_checkpoint(tiny_model_path: str) -> None:
    state = _parameters(tiny_model_path)
    buckets = [pack_bucket(specs, state) for specs in _plan(state, "float32", 3)]
    count = len(buckets)
    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url]), tiny_model_path)
        engine.load_weight_buckets(buckets, version=4)
        (body,) = [b for r, b in fake.requests if r == "/update_weights_from_disk"]
        directory = Path(body["model_path"])
        assert body == {"model_path": str(directory), "weight_version": "4"}
        assert engine.weight_version == 4 and fake.weight_version == "4"
        assert _shards(directory) == [f"model-{k:05d}-of-{count:05d}.safetensors"
                                      for k in range(1, count + 1)]
        index = json.loads((directory / INDEX_FILE).read_text())
        assert set(index["weight_map"]) == set(state)
        for bucket, shard in zip(buckets, _shards(directory), strict=True):
            assert {index["weight_map"][s.name] for s in bucket.specs} == {shard}
            loaded = load_file(str(directory / shard))
            assert set(loaded) == {s.name for s in bucket.specs}
        assert index["metadata"]["total_size"] == sum(b.num_bytes for b in buckets)
        assert {"config.json", "tokenizer.json"} <= {p.name for p in directory.iterdir()}
        # A Hugging Face folder: it loads to the same weights, the tied head re-tied.
        reloaded = AutoModelForCausalLM.from_pretrained(str(directory)).state_dict()
        for name, tensor in AutoModelForCausalLM.from_pretrained(
                tiny_model_path).state_dict().items():
            assert torch.equal(reloaded[name], tensor), name

        # The next version in fewer (bf16) shards: no shard of the previous one is left.
        fewer = [pack_bucket(specs, state) for specs in _plan(state, "bfloat16", 2)]
        engine.load_weight_buckets(fewer, version=5)
        assert _shards(directory) == [f"model-{k:05d}-of-{len(fewer):05d}.safetensors"
                                      for k in range(1, len(fewer) + 1)]
        loaded = {}
        for shard in _shards(directory):
            loaded.update(load_file(str(directory / shard)))
        assert set(loaded) == set(state)
        for name, tensor in state.items():
            assert torch.equal(loaded[name], tensor.to(torch.bfloat16)), name
        assert fake.weight_version == "5"

        # A bucket whose buffer is short of its specs is refused before anything is written.
        short = WeightBucket(buckets[0].specs, buckets[0].data[:-4])
        with pytest.raises(ValueError, match="weight bucket 0"):
            engine.load_weight_buckets([short], version=6)
        assert fake.weight_version == "5"
        engine.shutdown()
        assert not directory.exists()


def _adapter_buckets(model_path: str, rank: int, seed: int) -> list[WeightBucket]:
    """One version of adapters for q_proj and v_proj of every layer, as a LoRA sync sends
    them (rollout/adapters.py), in two buckets."""
    from rollout.adapters import LORA_A, LORA_B, wire_name

    model = AutoModelForCausalLM.from_pretrained(model_path)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            tensors[wire_name(name, LORA_A)] = torch.randn(rank, module.in_features,
                                                           generator=gen)
            tensors[wire_name(name, LORA_B)] = torch.randn(module.out_features, rank,
                                                           generator=gen)
    specs = plan_buckets([(n, tuple(t.shape)) for n, t in tensors.items()], "float32",
                         sum(t.nbytes for t in tensors.values()) // 2)
    return [pack_bucket(s, tensors) for s in specs]


def test_an_adapter_sync_loads_a_peft_folder_and_requests_name_it(tiny_model_path: str
                                                                  ) -> None:
    """A LoRA sync: peft's folder (alpha = r: B came scaled) loaded by /load_lora_adapter
    under a name per version, /generate naming it, the version before unloaded."""
    from rollout.adapters import adapter_factors, read_peft_folder

    with serve_fake_sglang() as (url, fake):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url]), tiny_model_path)
        engine.generate(PROMPTS[:2], SamplingConfig(max_new_tokens=4), seed=0)
        first = _adapter_buckets(tiny_model_path, rank=4, seed=0)
        engine.load_weight_buckets(first, version=1)
        engine.generate(PROMPTS[:2], SamplingConfig(max_new_tokens=4), seed=0)
        engine.load_weight_buckets(_adapter_buckets(tiny_model_path, 4, seed=1), version=2)
        engine.generate(PROMPTS[:3], SamplingConfig(max_new_tokens=4), seed=0)
        loads = [b for r, b in fake.requests if r == "/load_lora_adapter"]
        first_name, second_name = (b["lora_name"] for b in loads)
        assert first_name.startswith("tally-") and first_name.endswith("-v1")
        assert second_name == first_name.removesuffix("-v1") + "-v2"
        assert [b for r, b in fake.requests if r == "/unload_lora_adapter"] == [
            {"lora_name": first_name}]
        assert list(fake.loras) == [second_name] and engine.weight_version == 2
        generated = [b.get("lora_path") for r, b in fake.requests if r == "/generate"]
        assert generated == [None, [first_name] * 2, [second_name] * 3]
        config, factors = read_peft_folder(loads[1]["lora_path"])
        assert config["r"] == config["lora_alpha"] == 4
        assert config["target_modules"] == ["q_proj", "v_proj"]
        sent = adapter_factors(_adapter_buckets(tiny_model_path, 4, seed=1))
        assert factors.keys() == sent.keys()
        for module, (a, b) in factors.items():
            assert torch.equal(a, sent[module][0]) and torch.equal(b, sent[module][1])
        assert not Path(loads[0]["lora_path"]).exists()  # the unloaded version's folder
        # Another engine on the same server (another job) loads its version 2 beside it;
        # an adapter the server refuses fails the sync, naming the version.
        other = SGLangEngine(SGLangEngineConfig(urls=[url]), tiny_model_path)
        other.load_weight_buckets(_adapter_buckets(tiny_model_path, 4, seed=2), version=2)
        assert len(fake.loras) == 2
        taken = f"{other.lora_name.removesuffix('-v2')}-v3"
        fake.loras[taken] = "taken"
        with pytest.raises(SGLangError, match="load_lora_adapter: weight version 3: cannot"):
            other.load_weight_buckets(_adapter_buckets(tiny_model_path, 4, seed=3), version=3)
        assert other.weight_version == 2
        other.shutdown()  # servers given by URL: each engine unloads its own adapter
        engine.shutdown()
        assert list(fake.loras) == [taken]


def test_launch_command_serves_lora_when_the_job_trains_adapters() -> None:
    from services.config.job import parse_job_config

    job = parse_job_config("", ["rollout.engine.type=sglang", "trainer.lora.rank=8",
                                "trainer.lora.target_modules=[q_proj, v_proj]"])
    command = launch_command(job.rollout.engine, "/models/m", port=1)
    flags = command[command.index("--enable-lora"):]
    assert flags == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                     "q_proj", "v_proj"]
    assert job.weight_transport() == "disk"  # adapters as files, not whole weights
    every = parse_job_config("", ["rollout.engine.type=sglang", "trainer.lora.rank=4"])
    assert every.rollout.engine.lora_target_modules == ["all"]
    assert "--enable-lora" not in launch_command(SGLangEngineConfig(), "/models/m", port=1)


def test_eos_as_the_last_allowed_token_is_a_stop(tiny_model_path: str) -> None:
    """SGLang tests max_new_tokens before EOS, so an EOS sampled as the last allowed token
    comes back as "length" (the fake does as SGLang); the engine reports "stop": the
    response ended, it was not cut (truncated, or continued by a partial rollout)."""
    with serve_fake_sglang() as (url, _):
        engine = SGLangEngine(SGLangEngineConfig(urls=[url]), tiny_model_path)
        even, odd = [1, 69], [1, 70]
        at_limit, cut = engine.generate([even, odd], SamplingConfig(max_new_tokens=3), seed=0)
    raw = fake_generation(even, {"max_new_tokens": 3})["meta_info"]
    assert raw["finish_reason"]["type"] == "length" and at_limit.token_ids[-1] == EOS
    assert at_limit.finish_reason == "stop"
    assert cut.finish_reason == "length" and EOS not in cut.token_ids
