"""JobConfig: bad configs fail before anything starts, with the field or line named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.config.job import (
    ConfigError,
    ConfigProblem,
    JobConfig,
    job_json_schema,
    load_job_config,
    parse_job_config,
)

ROOT = Path(__file__).resolve().parents[3]


def test_shipped_configs_are_valid() -> None:
    configs = [path for path in sorted((ROOT / "configs").glob("*.yaml"))
               if not path.name.startswith("rm-")]  # train-rm: tests/services/train_rm/
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


def test_ppo_with_a_critic_is_refused_where_it_cannot_run() -> None:
    """gae needs the critic's values, a critic serves gae only, and only FSDP has a value
    model: each refused in one line naming the field; GAE's settings belong to gae; the
    critic's trainer config takes the policy's layout unless it sets its own."""
    gae = "rollout: {advantage: {type: gae}}\n"
    with pytest.raises(ConfigError, match=r"rollout\.advantage\.type: gae needs .* "
                                          r"critic\.enabled: true"):
        parse_job_config(gae)
    with pytest.raises(ConfigError, match=r"critic\.enabled: the critic's values are used by "
                                          r"rollout\.advantage\.type: gae, not grpo"):
        parse_job_config("critic: {enabled: true}\n")
    with pytest.raises(ConfigError, match=r"critic\.enabled: the critic trains on "
                                          r"trainer\.backend: fsdp only"):
        parse_job_config(gae + "critic: {enabled: true}\ntrainer: {backend: megatron}\n")
    with pytest.raises(ConfigError, match=r"lam: only applies to type=gae, not type=grpo"):
        parse_job_config("rollout: {advantage: {type: grpo, lam: 0.9}}\n")
    job = parse_job_config(gae + "critic: {enabled: true, cp_size: 2, aggregation: token_mean}"
                           "\ntrainer: {dp_size: 2, shared_prefix: true}\n")
    critic = job.critic_trainer_config()
    assert (critic.dp_size, critic.cp_size, critic.lora, critic.loss.kl_coef) == (2, 2, None, 0)
    assert not critic.shares_prefix  # CP 2 cannot share a prompt: off for the critic only
    assert job.critic_objective_config().pg.mode == "token_mean"
    assert JobConfig.model_validate(job.model_dump()) == job  # a dumped config validates


def test_a_shared_prefix_is_refused_where_it_cannot_run() -> None:
    """true insists: refused under CP (naming trainer.cp_size), padding and Megatron; the
    default (None) resolves to on only where it applies."""
    with pytest.raises(ConfigError, match=r"shared_prefix.*trainer\.cp_size=2"):
        parse_job_config("trainer: {shared_prefix: true, cp_size: 2}\n")
    with pytest.raises(ConfigError, match=r"shared_prefix: needs packed rows"):
        parse_job_config("trainer: {shared_prefix: true, packing: false}\n")
    with pytest.raises(ConfigError, match=r"shared_prefix: backend=megatron"):
        parse_job_config("trainer: {shared_prefix: true, backend: megatron}\n")
    assert parse_job_config("name: x\n").trainer.shares_prefix
    assert not parse_job_config("trainer: {cp_size: 2}\n").trainer.shares_prefix
    assert not parse_job_config("trainer: {backend: megatron}\n").trainer.shares_prefix


def test_num_ranks_must_match_layout() -> None:
    with pytest.raises(ConfigError, match=r"num_ranks: 3 trainer actors.*= 4"):
        parse_job_config("num_ranks: 3\ntrainer: {dp_size: 2, cp_size: 2}\n")


def test_a_weight_transport_must_reach_the_engines() -> None:
    sglang = "rollout: {engine: {type: sglang, urls: ['http://127.0.0.1:30000']}}\n"
    with pytest.raises(ConfigError, match=r"trainer\.weight_sync\.transport: nccl cannot "
                                          r"reach torch engines; use one of auto, in_process, "
                                          r"object_store"):
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


def test_colocated_torch_engines_run_in_the_trainer_ranks_where_they_can() -> None:
    assert parse_job_config("colocate: true\n").weight_transport() == "in_process"
    assert parse_job_config("colocate: true\ntrainer: {weight_sync: {transport: "
                            "object_store}}\n").weight_transport() == "object_store"
    megatron = parse_job_config("colocate: true\ntrainer: {backend: megatron}\n")
    assert megatron.weight_transport() == "object_store"
    with pytest.raises(ConfigError, match=r"in_process runs the engines inside the trainer "
                                          r"ranks; set colocate: true"):
        parse_job_config("trainer: {weight_sync: {transport: in_process}}\n")
    with pytest.raises(ConfigError, match=r"in_process needs trainer\.backend: fsdp"):
        parse_job_config("colocate: true\ntrainer: {backend: megatron, weight_sync: "
                         "{transport: in_process}}\n")
    with pytest.raises(ConfigError, match=r"rollout\.engine\.num_engines: 3 engines inside "
                                          r"the trainer ranks need as many ranks; the trainer "
                                          r"has 2"):
        parse_job_config("colocate: true\nrollout: {engine: {num_engines: 3}}\n"
                         "trainer: {dp_size: 2}\n")
    waiting = parse_job_config("colocate: true\nrollout: {async_steps: 1}\n"
                               "trainer: {dp_size: 2, loss: {tis_cap: 2.0}}\n").warnings()
    assert [w.field for w in waiting] == ["rollout.engine.num_engines"]
    assert "a rank without an engine waits inside the next collective" in waiting[0].message
    threads = parse_job_config("colocate: true\nrollout: {engine: {num_threads: 2}}\n")
    assert [(w.field, "no effect on the colocated" in w.message)
            for w in threads.warnings()] == [("rollout.engine.num_threads", True)]


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


def test_switching_a_variant_type_by_set_drops_the_old_variants_fields() -> None:
    """The README's GPU line: smollm2-math.yaml's torch-engine fields (num_threads, …)
    do not make ``--set rollout.engine.type=sglang`` an unknown-key error; each dropped
    field is said, and a field both variants have is kept."""
    text = (ROOT / "configs" / "smollm2-math.yaml").read_text()
    torch_only = {"num_threads", "device", "kv_cache"} & set(
        parse_job_config(text).rollout.engine.model_fields_set)
    assert torch_only, "the shipped config no longer sets a torch-only engine field"
    config = parse_job_config(text, ["rollout.engine.type=sglang"])
    assert config.rollout.engine.type == "sglang"
    said = {p.field: p.message for p in config.warnings()}
    for name in torch_only:
        assert "dropped: a field of the previous rollout.engine type" in \
            said[f"rollout.engine.{name}"]
    assert config.rollout.engine.num_engines == parse_job_config(text).rollout.engine.num_engines
    # an unknown type drops nothing: validation names the type instead
    with pytest.raises(ConfigError, match=r"rollout\.engine"):
        parse_job_config(text, ["rollout.engine.type=vllm"])


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
    from services.runtime.preflight import preflight

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
    from services.config.docs import configuration_markdown

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
    assert "ppo ratio is exactly 1" in warnings[0].message
    # gspo's own clip default is no setting of the user's: nothing to warn about
    assert parse_job_config("trainer: {loss: {policy_loss: gspo}}\n").warnings() == []
    own = parse_job_config("trainer: {loss: {policy_loss: gspo, eps_clip_high: 0.01}}\n")
    assert [w.field for w in own.warnings()] == ["trainer.loss.eps_clip_high"]
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
    assert problem.field == "rollout.sampling.stop[0]"


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
    from services.config.job import error_field, load_yaml, set_dotted

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
        "trainer.optimizer[0]"


def test_sglang_top_k_one_at_a_temperature_is_refused_at_submit_naming_the_field() -> None:
    """SGLang's greedy path reports log-probs of the unscaled softmax: refused before any
    actor starts, the problem on ``rollout.sampling.top_k``."""
    overrides = ["rollout.engine.type=sglang", "rollout.sampling.top_k=1",
                 "rollout.sampling.temperature=0.7"]
    with pytest.raises(ConfigError) as caught:
        parse_job_config((ROOT / "configs" / "demo.yaml").read_text(), overrides)
    fields = [problem.field for problem in caught.value.problems]
    assert fields == ["rollout.sampling.top_k"], caught.value.problems


EMPTY = "is empty; a job config is a YAML mapping, e.g. configs/demo.yaml"


@pytest.mark.parametrize("text", ["", "\n  \n", "# only a comment\n", "null\n", "~\n"])
def test_an_empty_config_file_is_refused_not_run_as_the_defaults(tmp_path: Path,
                                                                 text: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_job_config(path, ["num_steps=3"])
    assert str(caught.value) == f"{path}: the file {EMPTY}"
    assert caught.value.problems == [ConfigProblem("", f"the file {EMPTY}")]


def test_an_explicit_empty_mapping_is_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("{}\n")
    assert load_job_config(tmp_path / "job.yaml").num_steps == JobConfig().num_steps
    assert parse_job_config("{}\n") == parse_job_config("") == JobConfig()  # "" is no text
    with pytest.raises(ConfigError, match=f"^<config>: the config {EMPTY}$"):
        parse_job_config("# nothing\n")


def test_a_problem_of_the_whole_config_has_no_root_prefix() -> None:
    from pydantic import BaseModel, ValidationError, model_validator

    from services.config.errors import validation_error

    class Whole(BaseModel):
        @model_validator(mode="after")
        def _never(self) -> Whole:
            raise ValueError("nothing here can run")

    with pytest.raises(ValidationError) as caught:
        Whole.model_validate({})
    err = validation_error(caught.value, "job.yaml", Whole)
    assert str(err) == "job.yaml: nothing here can run"  # one problem: one line
    assert err.problems == [ConfigProblem("", "nothing here can run")]


@pytest.mark.parametrize(("text", "field", "message"), [
    ("trainer: {optimizer: {lrr: 1.0e-5}}", "trainer.optimizer.lrr",
     "unknown key; did you mean lr?"),
    ("num_step: 3", "num_step", "unknown key; did you mean num_steps?"),
    ("rollout: {smapling: {temperature: 1.0}}", "rollout.smapling",  # two letters swapped
     "unknown key; did you mean sampling?"),
    ("rollout: {engine: {type: sglang, urlz: ['http://h:1']}}", "rollout.engine.urlz",
     "unknown key; did you mean urls?"),
    ("trainer: {optimizer: {learning_rate: 0.1}}", "trainer.optimizer.learning_rate",
     "unknown key"),  # nothing one edit away: nothing suggested
    ("rollout: {dataset: {type: jsonl, path: d.jsonl, prompt_kye: q}}",
     "rollout.dataset.prompt_kye", "unknown key; did you mean prompt_key?"),
])
def test_an_unknown_key_names_the_known_key_one_edit_away(text: str, field: str,
                                                          message: str) -> None:
    assert problems_of(text + "\n") == [ConfigProblem(field, message)]
    with pytest.raises(ConfigError) as caught:
        parse_job_config(text + "\n", source="job.yaml")
    assert str(caught.value) == f"job.yaml: {field}: {message}"  # one line


def test_one_edit_is_the_damerau_levenshtein_distance_one() -> None:
    from services.config.errors import did_you_mean, one_edit_apart

    assert [one_edit_apart("lr", w) for w in ("lrr", "l", "lt", "rl", "lr", "lrrr")] == [
        True, True, True, True, False, False]
    assert did_you_mean("sed", ["seed", "shuffle", "set"]) == "; did you mean seed or set?"
    assert did_you_mean("zzz", ["seed"]) == ""


DATASET_TYPES = "synthetic, jsonl, parquet, math_words, reasoning_gym"


@pytest.mark.parametrize(("text", "field", "message"), [
    ("rollout: {dataset: {path: d.jsonl}}", "rollout.dataset.type",
     f"missing; one of {DATASET_TYPES}"),
    ("rollout: {dataset: {type: json, path: d.jsonl}}", "rollout.dataset.type",
     f"'json' is not one of {DATASET_TYPES}; did you mean jsonl?"),
    ("rollout: {dataset: {type: csv, path: d.csv}}", "rollout.dataset.type",
     f"'csv' is not one of {DATASET_TYPES}"),
    ("eval: {dataset: {path: heldout.jsonl}}", "eval.dataset.type",
     f"missing; one of {DATASET_TYPES}"),
])
def test_a_variant_without_a_known_type_lists_the_types(text: str, field: str,
                                                        message: str) -> None:
    assert problems_of(text + "\n") == [ConfigProblem(field, message)]


def test_engine_settings_without_an_engine_block_are_a_torch_engine() -> None:
    config = parse_job_config("", ["rollout.engine.device=cuda"])
    assert (config.rollout.engine.type, config.rollout.engine.device) == ("torch", "cuda")


def test_fields_are_named_without_the_variant_steps_of_a_union() -> None:
    # pydantic says rollout.dataset.jsonl.path and aggregation.divisor.float
    assert problems_of("rollout: {dataset: {type: jsonl}}\n") == [
        ConfigProblem("rollout.dataset.path", "Field required")]
    assert problems_of("eval: {dataset: {type: parquet}}\n") == [
        ConfigProblem("eval.dataset.path", "Field required")]
    assert problems_of("aggregation: {mode: constant, divisor: many}\n") == [ConfigProblem(
        "aggregation.divisor", "Input should be a valid number, unable to parse string as a "
                               "number; or Input should be 'max_response_len'")]


TRAINING_FILE = ("rollout: {dataset: {type: jsonl, path: data/train.jsonl, prompt_key: "
                 "question, label_key: answer}}\n")


def test_eval_dataset_may_be_a_path_read_like_the_training_file() -> None:
    config = parse_job_config(TRAINING_FILE + "eval: {enabled: true, dataset: data/h.jsonl}\n")
    held_out = config.eval_dataset()
    assert (held_out.type, held_out.path, held_out.prompt_key, held_out.label_key) == (
        "jsonl", "data/h.jsonl", "question", "answer")
    assert config.eval.dataset == "data/h.jsonl"  # the resolved config reads back the same
    assert JobConfig.model_validate_json(config.model_dump_json()).eval_dataset() == held_out
    parquet = parse_job_config("eval: {enabled: true, dataset: h.parquet}\n").eval_dataset()
    assert (parquet.type, parquet.prompt_key, parquet.label_key) == (
        "parquet", "prompt", "label")  # the defaults beside a built-in training set


HAS_NO_SPLIT = ("rollout.dataset (type jsonl) has no held-out split; name the held-out "
                "prompts here (a JSONL path, e.g. eval.dataset: data/heldout.jsonl, or a "
                "dataset block), or set eval.split_fraction (e.g. 0.1) to hold out that "
                "share of the training file")


def test_eval_on_a_file_without_held_out_records_says_both_ways_out() -> None:
    assert problems_of(TRAINING_FILE + "eval: {enabled: true}\n") == [
        ConfigProblem("eval.dataset", HAS_NO_SPLIT)]
    assert problems_of("eval: {enabled: true}\n") == [ConfigProblem(
        "eval.dataset", "rollout.dataset (type synthetic) has no held-out split; name the "
                        "held-out prompts here (a JSONL path, e.g. eval.dataset: "
                        "data/heldout.jsonl, or a dataset block)")]
    assert problems_of(TRAINING_FILE + "eval: {enabled: true, dataset: data/train.jsonl}\n") \
        == [ConfigProblem("eval.dataset", "is the training file, so every evaluated record is "
                          "trained on; name a held-out file, or leave eval.dataset unset and "
                          "set eval.split_fraction (e.g. 0.1)")]


def test_eval_split_fraction_carves_held_out_records_from_the_training_file() -> None:
    config = parse_job_config(TRAINING_FILE + "eval: {enabled: true, split_fraction: 0.1}\n")
    train, held_out = config.rollout.dataset, config.eval_dataset()
    assert (train.split, train.split_fraction) == ("train", 0.1)  # what the job trains on
    assert (held_out.split, held_out.split_fraction, held_out.path) == (
        "heldout", 0.1, "data/train.jsonl")
    assert held_out.prompt_key == "question"
    again = JobConfig.model_validate_json(config.model_dump_json())
    assert again == config and again.eval_dataset() == held_out
    said = parse_job_config(TRAINING_FILE.replace("answer}", "answer, split_fraction: 0.1}")
                            + "eval: {enabled: true, split_fraction: 0.1}\n")
    assert said == config


@pytest.mark.parametrize(("text", "field", "message"), [
    (TRAINING_FILE.replace("answer}", "answer, split_fraction: 0.2}")
     + "eval: {split_fraction: 0.1}", "eval.split_fraction",
     "0.1 differs from rollout.dataset.split_fraction 0.2; set one of the two"),
    (TRAINING_FILE + "eval: {split_fraction: 0.1, dataset: h.jsonl}", "eval.split_fraction",
     "carves the held-out prompts out of rollout.dataset, but eval.dataset names them "
     "already; set one of the two"),
    ("rollout: {dataset: {type: math_words}}\neval: {split_fraction: 0.1}",
     "eval.split_fraction", "splits a jsonl or parquet rollout.dataset, not math_words (it "
     "has a held-out split of its own, which eval uses when eval.dataset is unset: drop "
     "split_fraction)"),
    ("eval: {split_fraction: 0.1}", "eval.split_fraction", "splits a jsonl or parquet "
     "rollout.dataset, not synthetic; name the held-out prompts in eval.dataset instead"),
    (TRAINING_FILE + "eval: {split_fraction: 1}", "eval.split_fraction",
     "Input should be less than 1"),
    ("rollout: {dataset: {type: math_words, split: heldout}}\neval: {enabled: true}",
     "eval.dataset", "rollout.dataset.split is heldout, so its held-out split is what the "
     "job trains on; train on split: train, or name the held-out prompts here"),
])
def test_eval_split_rules_name_the_field(text: str, field: str, message: str) -> None:
    assert problems_of(text + "\n") == [ConfigProblem(field, message)]


@pytest.mark.parametrize("advantage", [
    "rollout.advantage={type: reinforce_pp}", "rollout.advantage={type: reward}",
    "rollout.advantage={type: distill, teacher: tiny, coef: 0.5}",
    "rollout.teacher={model: tiny, coef: 0.5}"])
def test_a_dumped_config_of_every_advantage_validates_again_unchanged(advantage: str) -> None:
    """The job folder's resolved config and a session's config are dumps, every field at
    its value, validated again: a rule about what a user set must not refuse them."""
    config = load_job_config(ROOT / "configs" / "demo.yaml", [advantage])
    assert JobConfig.model_validate(config.model_dump()) == config
    assert JobConfig.model_validate_json(config.model_dump_json()) == config


def test_the_policys_schedule_leaves_out_the_critics_warmup_rollouts() -> None:
    config = parse_job_config("num_steps: 5\nrollout: {rollout_batch_size: 4, "
                              "global_batch_size: 8, n_samples_per_prompt: 4, "
                              "advantage: {type: gae}}\ntrainer: {ppo_epochs: 2}\n"
                              "critic: {enabled: true, warmup_steps: 2}\n")
    assert config.num_updates_per_rollout == 4  # 2 mini-batches x 2 epochs
    assert config.num_optimizer_steps == 5 * 4  # the critic steps on every rollout
    assert config.policy_schedule_steps == (5 - 2) * 4
    no_critic = parse_job_config("num_steps: 5\n")
    assert no_critic.policy_schedule_steps == no_critic.num_optimizer_steps
