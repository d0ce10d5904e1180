"""RolloutConfig validation: limits in the types, named cross-field rules, clear messages."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from pydantic import ValidationError

from rollout.config import (
    FileDatasetConfig,
    RolloutConfig,
    SGLangEngineConfig,
    SyntheticDatasetConfig,
    TorchEngineConfig,
)
from rollout.engines import EngineUnavailableError, check_engine_available


def _error(data: dict) -> str:
    with pytest.raises(ValidationError) as info:
        RolloutConfig.model_validate(data)
    return str(info.value)


def test_defaults_are_valid() -> None:
    config = RolloutConfig()
    assert config.model == "tiny"
    assert isinstance(config.dataset, SyntheticDatasetConfig)
    assert isinstance(config.engine, TorchEngineConfig)
    assert config.num_prompts_per_step == config.global_batch_size // config.n_samples_per_prompt


def test_batch_must_hold_whole_groups() -> None:
    message = _error({"global_batch_size": 10, "n_samples_per_prompt": 4})
    assert "global_batch_size: 10 is not a multiple of n_samples_per_prompt=4" in message


def test_field_limits_name_the_field() -> None:
    assert "sampling.top_p" in _error({"sampling": {"top_p": 0.0}})
    assert "sampling.temperature" in _error({"sampling": {"temperature": -1}})
    assert "sampling.max_new_tokens" in _error({"sampling": {"max_new_tokens": 0}})
    assert "reward.one.rule.max_error_rate" in _error({"reward": {"max_error_rate": 1.5}})
    assert "n_samples_per_prompt" in _error({"n_samples_per_prompt": 0})
    assert "stop: stop strings must be non-empty" in _error({"sampling": {"stop": [""]}})


def test_unknown_keys_are_rejected() -> None:
    message = _error({"sampling": {"temprature": 0.5}})
    assert "sampling.temprature" in message and "Extra inputs are not permitted" in message


def test_dataset_and_engine_are_discriminated_on_type() -> None:
    config = RolloutConfig.model_validate(
        {
            "dataset": {"type": "parquet", "path": "/data/train.parquet", "label_key": None},
            "engine": {"type": "sglang", "urls": ["http://10.0.0.1:30000", "http://h:1"]},
        }
    )
    assert isinstance(config.dataset, FileDatasetConfig) and config.dataset.type == "parquet"
    assert isinstance(config.engine, SGLangEngineConfig) and config.engine.num_engines == 2
    message = _error({"dataset": {"type": "csv", "path": "x"}})
    assert "dataset" in message and "'synthetic', 'jsonl', 'parquet'" in message
    assert "dataset.synthetic.task" in _error({"dataset": {"type": "synthetic", "task": "sort"}})


def test_reward_custom_function_rules() -> None:
    assert "custom_function: type=custom needs 'module:function'" in _error(
        {"reward": {"type": "custom"}}
    )
    assert "custom_function: expected 'module:function', got 'my_rewards'" in _error(
        {"reward": {"type": "custom", "custom_function": "my_rewards"}}
    )
    assert "custom_function: only type=custom takes a function, but type=boxed" in _error(
        {"reward": {"type": "boxed", "custom_function": "a:b"}}
    )


def test_normalize_std_only_for_grpo_and_dynamic_sampling_needs_groups() -> None:
    assert "normalize_std: only applies to type=grpo, not type=reinforce_pp" in _error(
        {"advantage": {"type": "reinforce_pp", "normalize_std": False}}
    )
    assert "dynamic_sampling.enabled: needs n_samples_per_prompt >= 2" in _error(
        {"dynamic_sampling": {"enabled": True}, "n_samples_per_prompt": 1, "global_batch_size": 4}
    )


def test_sglang_urls_and_num_engines() -> None:
    message = _error({"engine": {"type": "sglang", "urls": ["http://a:1"], "num_engines": 2}})
    assert "num_engines: 2 does not match the 1 urls" in message
    assert "urls: 'a:1' must start with http:// or https://" in _error(
        {"engine": {"type": "sglang", "urls": ["a:1"]}}
    )
    launched = SGLangEngineConfig(num_engines=2, tp_size=2)
    assert launched.actor_num_gpus == 2.0
    assert SGLangEngineConfig(urls=["http://a:1"]).actor_num_gpus == 0.0


def test_sglang_refuses_top_k_one_unless_temperature_one() -> None:
    """SGLang's greedy path (top_k = 1) reports log-probs of softmax(logits), not of
    softmax(logits / T): at T != 1 they would not be the sampling distribution's."""
    sglang = {"type": "sglang", "urls": ["http://a:1"]}
    message = _error({"engine": sglang, "sampling": {"top_k": 1, "temperature": 0.7}})
    assert "sampling.top_k: 1 with temperature=0.7 on the sglang engine" in message
    assert "unscaled softmax(logits)" in message
    RolloutConfig.model_validate({"engine": sglang, "sampling": {"top_k": 1}})  # T = 1
    RolloutConfig.model_validate({"engine": sglang, "sampling": {"top_k": 2, "temperature": 0.7}})
    # Our torch engine scales before it picks the top token: no such restriction.
    RolloutConfig.model_validate({"sampling": {"top_k": 1, "temperature": 0.7}})


def test_check_engine_available(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sglang" else real_find_spec(name, *a),
    )
    with pytest.raises(EngineUnavailableError, match="the sglang package is not installed"):
        check_engine_available(RolloutConfig(engine=SGLangEngineConfig()))
    # Connecting to running servers speaks HTTP only: no sglang package needed.
    check_engine_available(RolloutConfig(engine=SGLangEngineConfig(urls=["http://a:1"])))
    check_engine_available(RolloutConfig())


def test_config_and_engine_check_import_neither_torch_nor_ray() -> None:
    code = (
        "import sys, rollout.config, rollout.engines\n"
        "heavy = {'torch', 'ray', 'transformers', 'sglang'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("extra", "field"), [
    ({"async_steps": 0}, "partial_rollout: needs rollout.async_steps"),
    ({"sampling": {"stop": ["x"]}}, "partial_rollout: not with sampling.stop"),
    ({"max_staleness": 0, "async_steps": 2}, "max_staleness: 0 is below async_steps=2"),
    ({"partial_chunk_tokens": 5}, "partial_chunk_tokens: 5 does not divide"),
    ({"partial_rollout": False, "max_staleness": 3}, "max_staleness: only applies with"),
])
def test_partial_rollout_errors_name_the_field(extra: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(field)):
        RolloutConfig.model_validate({"partial_rollout": True, "async_steps": 1, **extra})


def test_partial_rollout_defaults() -> None:
    config = RolloutConfig.model_validate({"partial_rollout": True, "async_steps": 2,
                                           "sampling": {"max_new_tokens": 100}})
    # chunk: the largest divisor of 100 ≤ 100/8; staleness: 2k − 1 + 100/10 (none dropped)
    assert (config.chunk_tokens, config.staleness_bound) == (10, 13)

