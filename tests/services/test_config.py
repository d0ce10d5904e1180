"""JobConfig: bad configs fail before anything starts, with the field or line named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.config import (
    ConfigError,
    ConfigProblem,
    JobConfig,
    job_json_schema,
    load_job_config,
    parse_job_config,
)

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_are_valid() -> None:
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs, "configs/ ships example job configs"
    for path in configs:
        load_job_config(path)


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.optimizer\.learning_rate: unknown key"):
        parse_job_config("trainer:\n  optimizer:\n    learning_rate: 0.1\n")


def test_yaml_syntax_error_names_the_line() -> None:
    with pytest.raises(ConfigError, match="line 3, column 15 not valid YAML: mapping values"):
        parse_job_config("name: x\nnum_steps: 3\nrollout: model: tiny\n")


def test_prompt_mean_needs_whole_groups() -> None:
    # global_batch_size must be a multiple of G (the rollout's own rule names the field).
    with pytest.raises(ConfigError, match="global_batch_size: 10 is not a multiple"):
        parse_job_config("aggregation: {mode: prompt_mean}\n"
                         "rollout: {n_samples_per_prompt: 4, global_batch_size: 10}\n")


def test_aggregation_rules_surface_with_their_path() -> None:
    with pytest.raises(ConfigError, match="aggregation: divisor: mode=constant needs a divisor"):
        parse_job_config("aggregation: {mode: constant}\n")
    with pytest.raises(ConfigError, match="conflicts with mode=prompt_mean"):
        parse_job_config("aggregation: {mode: prompt_mean, calculate_per_token_loss: true}\n")


def test_num_ranks_must_match_layout() -> None:
    with pytest.raises(ConfigError, match=r"num_ranks: 3 trainer actors.*= 4"):
        parse_job_config("num_ranks: 3\ntrainer: {dp_size: 2, cp_size: 2}\n")


def test_a_weight_transport_must_reach_the_engines() -> None:
    sglang = "rollout: {engine: {type: sglang, urls: ['http://127.0.0.1:30000']}}\n"
    with pytest.raises(ConfigError, match=r"trainer\.weight_sync\.transport: nccl cannot "
                                          r"reach torch engines; use one of auto, object_s"):
        parse_job_config("trainer: {weight_sync: {transport: nccl}}\n")
    with pytest.raises(ConfigError, match=r"weight_sync\.transport: nccl sends from GPU.*"
                                          r"trainer\.num_gpus_per_rank"):
        parse_job_config(sglang + "trainer: {weight_sync: {transport: nccl}}\n")
    with pytest.raises(ConfigError, match=r"cuda_ipc needs the engine.*colocate: true"):
        parse_job_config(sglang + "trainer: {num_gpus_per_rank: 1, weight_sync: "
                                  "{transport: cuda_ipc}}\n")
    with pytest.raises(ConfigError, match=r"trainer\.weight_sync\.bucket_mb: Input should be "
                                          r"greater than 0"):
        parse_job_config("trainer: {weight_sync: {bucket_mb: 0}}\n")
    assert parse_job_config("{}\n").weight_transport() == "object_store"
    assert parse_job_config(sglang).weight_transport() == "disk"  # CPU trainer ranks
    gpu = parse_job_config(sglang + "trainer: {num_gpus_per_rank: 1}\n")
    assert gpu.weight_transport() == "nccl" and gpu.engine_dtype() == "bfloat16"
    half = parse_job_config("rollout: {engine: {type: torch, dtype: bfloat16}}\n")
    assert half.engine_dtype() == "bfloat16"


def test_pg_aggregation_lives_at_the_top_level() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.loss\.aggregation: set the pg aggregation"):
        parse_job_config("trainer: {loss: {aggregation: {mode: token_mean}}}\n")


def test_overrides_apply_and_are_validated() -> None:
    config = parse_job_config("name: x\n", ["trainer.optimizer.lr=1e-5",
                                            "aggregation.mode=token_mean"])
    assert config.trainer.optimizer.lr == 1e-5
    assert config.objective_config().pg.mode == "token_mean"
    with pytest.raises(ConfigError, match=r"--set .trainer.: expected key\.path=value"):
        parse_job_config("name: x\n", ["trainer"])
    with pytest.raises(ConfigError, match=r"trainer\.optimizer\.lr: Input should be greater"):
        parse_job_config("name: x\n", ["trainer.optimizer.lr=-1"])


def problems_of(text: str, overrides: list[str] | None = None) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(text, overrides)
    return caught.value.problems


def test_errors_carry_each_field_with_its_full_path() -> None:
    assert problems_of("trainer:\n  optimizer:\n    learning_rate: 0.1\n") == [
        ConfigProblem("trainer.optimizer.learning_rate", "unknown key")]
    # a section's rule names its own field: the problem has the whole path
    problems = problems_of("aggregation: {mode: constant}\ntrainer: {dp_size: 0}\n")
    assert [p.field for p in problems] == ["aggregation.divisor", "trainer.dp_size"]
    assert problems[0].message.startswith("mode=constant needs a divisor")


def test_cross_field_rule_names_its_field() -> None:
    [problem] = problems_of("aggregation: {mode: prompt_mean}\n"
                            "rollout: {n_samples_per_prompt: 4, global_batch_size: 10}\n")
    assert problem.field == "rollout.global_batch_size"
    assert problem.message.startswith("10 is not a multiple of n_samples_per_prompt=4")
    [problem] = problems_of("num_ranks: 3\ntrainer: {dp_size: 2, cp_size: 2}\n")
    assert problem.field == "num_ranks" and problem.message.startswith("3 trainer actors")


def test_yaml_syntax_error_is_a_problem_of_the_whole_file() -> None:
    [problem] = problems_of("name: x\nnum_steps: 3\nrollout: model: tiny\n")
    assert problem.field == ""
    assert problem.message.startswith("line 3, column 15 not valid YAML: mapping values")


def test_bad_overrides_name_their_key() -> None:
    assert problems_of("name: x\n", ["trainer"]) == [
        ConfigProblem("trainer", "expected key.path=value")]
    [problem] = problems_of("name: x\n", ["trainer.optimizer.lr=[1"])
    assert problem.field == "trainer.optimizer.lr"
    assert problem.message.startswith("value is not valid YAML")
    assert problems_of("name: x\n", ["name.first=1"]) == [
        ConfigProblem("name.first", "'name' is not a section")]
    assert problems_of("name: x\n", ["trainer.optimizer.lr=-1"]) == [
        ConfigProblem("trainer.optimizer.lr", "Input should be greater than 0")]


def test_constant_max_response_len_resolves_to_rollout_budget() -> None:
    config = parse_job_config("aggregation: {mode: constant, divisor: max_response_len}\n"
                              "rollout: {sampling: {max_new_tokens: 12, temperature: 0.7}}\n")
    objective = config.objective_config()
    assert (objective.pg.divisor, objective.kl.divisor) == (12.0, 12.0)
    assert objective.temperature == 0.7


def test_greedy_sampling_cannot_be_trained() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.temperature: 0 \(greedy\)"):
        parse_job_config("rollout: {sampling: {temperature: 0}}\n")


def test_preflight_names_a_missing_dataset_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.preflight import preflight

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import` fails, installed or not
    config = parse_job_config("rollout: {dataset: {type: reasoning_gym, name: leg_counting}}\n")
    with pytest.raises(ConfigError) as caught:
        preflight(config)
    [problem] = caught.value.problems
    assert problem.field == "rollout.dataset.type"
    assert "pip install reasoning-gym" in problem.message


def test_yaml_is_loaded_safely() -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_job_config("name: !!python/object/apply:os.system ['true']\n")


def test_committed_json_schema_is_current() -> None:
    committed = (ROOT / "configs" / "tally.schema.json").read_text()
    assert committed == job_json_schema(), "run: tally schema > configs/tally.schema.json"


def test_generated_configuration_docs_are_current() -> None:
    from services.config_docs import configuration_markdown

    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == configuration_markdown(), (
        "run: tally schema --markdown > docs/configuration.md")


def test_several_optimizer_steps_per_rollout() -> None:
    config = parse_job_config("num_steps: 3\nrollout: {rollout_batch_size: 64, "
                              "global_batch_size: 128, n_samples_per_prompt: 8}\n"
                              "trainer: {ppo_epochs: 2}\n")
    assert config.rollout.num_samples_per_rollout == 512
    assert config.rollout.num_steps_per_rollout == 4
    assert config.num_updates_per_rollout == 8
    assert config.num_optimizer_steps == 24  # what the LR schedule counts
    default = parse_job_config("rollout: {global_batch_size: 32, n_samples_per_prompt: 8}\n")
    assert (default.rollout.num_prompts_per_rollout, default.num_updates_per_rollout) == (4, 1)


@pytest.mark.parametrize(("text", "field", "message"), [
    ("rollout: {rollout_batch_size: 6, global_batch_size: 32, n_samples_per_prompt: 8}",
     "rollout.rollout_batch_size", "48 samples per rollout is not a multiple of "
                                   "global_batch_size=32"),
    ("rollout: {global_batch_size: 12, n_samples_per_prompt: 8}",  # every mode, not only
     "rollout.global_batch_size", "is not a multiple of n_samples_per_prompt=8"),  # prompt_mean
    ("trainer: {ppo_epochs: 0}", "trainer.ppo_epochs", "greater than or equal to 1"),
    ("rollout: {rollout_batch_size: 0}", "rollout.rollout_batch_size", "greater than 0"),
])
def test_invalid_rollout_splits_are_refused_naming_the_field(text: str, field: str,
                                                           message: str) -> None:
    problems = problems_of(text + "\n")
    assert [p.field for p in problems] == [field], problems
    assert message in problems[0].message


def test_options_inert_with_one_update_per_rollout_warn() -> None:
    text = "trainer: {loss: {eps_clip_high: 0.28, dual_clip_c: 3.0}}\n"
    warnings = parse_job_config(text).warnings()
    assert [w.field for w in warnings] == ["trainer.loss.eps_clip_high",
                                           "trainer.loss.dual_clip_c"]
    assert "PPO ratio is exactly 1" in warnings[0].message
    several = parse_job_config(text + "rollout: {rollout_batch_size: 16}\n")
    assert several.warnings() == []
    rollout_ratio = parse_job_config(
        "trainer: {loss: {eps_clip_high: 0.28, old_log_probs: rollout}}\n")
    assert rollout_ratio.warnings() == []


def test_list_fields_are_capped_naming_the_field() -> None:
    stops = "[" + ", ".join(f"s{i}" for i in range(33)) + "]"
    [problem] = problems_of(f"rollout: {{sampling: {{stop: {stops}}}}}\n")
    assert problem.field == "rollout.sampling.stop" and "at most 32" in problem.message
    [problem] = problems_of("rollout: {sampling: {stop: [" + "x" * 300 + "]}}\n")
    assert problem.field == "rollout.sampling.stop.0"


def test_a_setting_chosen_by_a_rule_is_said_and_inert_tis_is_warned() -> None:
    implied = parse_job_config("rollout: {async_steps: 2}\n")
    assert implied.trainer.loss.tis_cap == 2.0  # in the resolved config, as documented
    (said,) = implied.warnings()
    assert said.field == "trainer.loss.tis_cap"
    assert "because rollout.async_steps is 2" in said.message
    chosen = parse_job_config("rollout: {async_steps: 2}\ntrainer: {loss: {tis_cap: null}}\n")
    assert chosen.trainer.loss.tis_cap is None and chosen.warnings() == []
    # The resolved config read back (the controller's config_resolved) chose nothing.
    assert JobConfig.model_validate_json(implied.model_dump_json()).warnings() == []
    inert = parse_job_config("rollout: {async_steps: 1}\n"
                             "trainer: {loss: {old_log_probs: rollout, tis_cap: 1.5}}\n")
    (warned,) = inert.warnings()
    assert warned.field == "trainer.loss.tis_cap" and "has no effect" in warned.message


def test_yaml_dotted_keys_and_error_fields_have_one_home() -> None:
    """The helpers the controller's submission shares with the CLI's parsing."""
    from services.config import error_field, load_yaml, set_dotted

    assert load_yaml("a: &x 1\nb: *x\n") == {"a": 1, "b": 1} and load_yaml("  ") == {}
    with pytest.raises(ConfigError, match="<config>: YAML anchors and aliases"):
        load_yaml("a: &x 1\nb: *x\n", aliases=False)
    with pytest.raises(ConfigError, match=r"^job\.yaml: line 1, column 5 not valid YAML"):
        load_yaml("a: b: c", "job.yaml")
    data: dict = {"rollout": {"model": "tiny"}}
    set_dotted(data, "rollout.dataset.path", "/x")
    assert data == {"rollout": {"model": "tiny", "dataset": {"path": "/x"}}}
    with pytest.raises(ConfigError) as err:
        set_dotted(data, "rollout.model.name", "y", source="--set rollout.model.name")
    assert err.value.problems == [ConfigProblem("rollout.model.name", "'model' is not a section")]
    assert error_field(("trainer", "function-after[_rule()]", "optimizer", 0)) == \
        "trainer.optimizer.0"


def test_sglang_top_k_one_at_a_temperature_is_refused_at_submit_naming_the_field() -> None:
    """SGLang's greedy path reports log-probs of the unscaled softmax: refused before any
    actor starts, the problem on ``rollout.sampling.top_k``."""
    overrides = ["rollout.engine.type=sglang", "rollout.sampling.top_k=1",
                 "rollout.sampling.temperature=0.7"]
    with pytest.raises(ConfigError) as caught:
        parse_job_config((ROOT / "configs" / "demo.yaml").read_text(), overrides)
    fields = [problem.field for problem in caught.value.problems]
    assert fields == ["rollout.sampling.top_k"], caught.value.problems
