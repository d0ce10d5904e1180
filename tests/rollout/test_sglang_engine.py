"""SGLangEngine against a loopback fake of SGLang's HTTP API; a real server on GPU."""

from __future__ import annotations

import importlib.util

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import SamplingConfig, SGLangEngineConfig
from rollout.engines.sglang_engine import SGLangEngine, SGLangError
from rollout.engines.sglang_server import launch_command
from tests.rollout.fake_sglang import (
    EOS,
    INITIAL_WEIGHT_VERSION,
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
        assert "model.safetensors" in fake.loaded_files[1]
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


@pytest.mark.gpu
def test_real_sglang_server_log_probs(tiny_model_path: str) -> None:
    """A launched SGLang server on the tiny model: log-probs match a teacher-forced pass."""
    if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
        pytest.skip("needs the sglang package and a CUDA GPU")
    # The char tokenizer is ours, not one SGLang knows: ids in, ids out. Head dim 16 is
    # below what the fused attention kernels take, so use the plain torch backend.
    extra_args = [
        "--dtype",
        "float32",
        "--skip-tokenizer-init",
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-backend-prefill",
        "disabled",
        "--attention-backend",
        "torch_native",
    ]
    config = SGLangEngineConfig(base_port=31500, mem_fraction_static=0.3, extra_args=extra_args)
    engine = SGLangEngine(config, tiny_model_path)
    try:
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
        generations = engine.generate(PROMPTS, sampling, seed=0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
        for prompt, gen in zip(PROMPTS, generations, strict=True):
            ids = torch.tensor([prompt + gen.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(gen.token_ids)[:, None])
            assert torch.allclose(torch.tensor(gen.log_probs), expected.squeeze(-1), atol=1e-3)
        engine.update_weights_from_disk(tiny_model_path)
    finally:
        engine.shutdown()
