"""Preflight: each check a job gets before anything starts, with its exact one-line message
(the field, the file:line, how to fix it). tests/e2e/test_first_hour.py feeds the
same inputs to `tally train` and `tally submit`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.plugins import check_object
from services.config.job import ConfigError, parse_job_config
from services.runtime.placement import check_local_head, starts_local_head
from services.runtime.preflight import preflight

ROOT = Path(__file__).resolve().parents[3]
HINT = ("save the model and its tokenizer there with save_pretrained, or make the folder "
        "with `tally import-model`")
LABEL_FIX = ("set label_key to the field holding the reference answer, or to null if the "
             "reward needs no label")
NOT_ON_PATH = ("no module of that name on the Python path (put it in the job's working "
               "directory or on PYTHONPATH, e.g. PYTHONPATH=. tally train ...)")
NO_GPU = "but this machine has no GPU (Ray head started by Tally: 4 CPUs, 0 GPUs)"


def jsonl(tmp: Path, name: str, *records: object) -> str:
    path = tmp / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


def dataset(path: str, *overrides: str, section: str = "rollout") -> list[str]:
    extra = ["eval.enabled=true"] if section == "eval" else []
    return [*extra, f"{section}.dataset.type=jsonl", f"{section}.dataset.path={path}",
            *overrides]


def problem(*overrides: str, local_head: bool = False) -> str:
    """The one line preflight refuses the demo-sized default config with."""
    with pytest.raises(ConfigError) as info:
        preflight(parse_job_config("", list(overrides)), local_head=local_head)
    assert len(info.value.problems) == 1, str(info.value)
    return str(info.value)


GOOD = {"prompt": "2+2=", "answer": 4}


def test_dataset_files(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    assert problem(*dataset(missing)) == \
        f"rollout.dataset.path: {missing} does not exist or is not a file"
    empty = jsonl(tmp_path, "empty.jsonl")
    assert problem(*dataset(empty)) == (f"rollout.dataset.path: {empty} has no records "
                                        "(empty file); a JSONL file holds one JSON object per line")
    broken = jsonl(tmp_path, "broken.jsonl", *[GOOD] * 9, '{"prompt": "3+3=" "answer": 6}')
    assert problem(*dataset(broken)) == (
        f"rollout.dataset.path: {broken}:10: invalid JSON (Expecting ',' delimiter at column "
        "19); each line holds one JSON object")


def test_records_missing_their_prompt_or_answer(tmp_path: Path) -> None:
    no_prompt = jsonl(tmp_path, "p.jsonl", GOOD, {"question": "1+1=", "answer": 2})
    assert problem(*dataset(no_prompt)) == (
        f"rollout.dataset.prompt_key: {no_prompt}:2: no field 'prompt'; fields are ['answer', "
        "'question']; set prompt_key to the field holding the prompt")
    no_answer = jsonl(tmp_path, "a.jsonl", *[GOOD] * 16, {"prompt": "1+1=", "solution": 2})
    assert problem(*dataset(no_answer)) == (
        f"rollout.dataset.label_key: {no_answer}:17: no field 'label' or 'answer' (the default "
        f"label fields); fields are ['prompt', 'solution']; {LABEL_FIX}")
    assert problem(*dataset(no_answer, "rollout.dataset.label_key=solution")) == (
        f"rollout.dataset.label_key: {no_answer}:1: no field 'solution'; fields are ['answer', "
        f"'prompt']; {LABEL_FIX}")
    assert preflight(parse_job_config("", dataset(no_answer, "rollout.dataset.label_key=null"))
                     ) == []


def test_eval_dataset_is_checked_like_the_training_one(tmp_path: Path) -> None:
    broken = jsonl(tmp_path, "held.jsonl", GOOD, "{")
    assert problem(*dataset(broken, section="eval")) == (
        f"eval.dataset.path: {broken}:2: invalid JSON (Expecting property name enclosed in "
        "double quotes at column 2); each line holds one JSON object")
    off = ["eval.enabled=false", "eval.dataset.type=jsonl", f"eval.dataset.path={broken}"]
    assert preflight(parse_job_config("", off)) == []  # evaluation off: never read
    assert problem("eval.enabled=true", f"eval.dataset={broken}") == (  # a path: that field
        f"eval.dataset: {broken}:2: invalid JSON (Expecting property name enclosed in double "
        "quotes at column 2); each line holds one JSON object")
    no_solution = jsonl(tmp_path, "s.jsonl", GOOD)
    train = jsonl(tmp_path, "train.jsonl", {"prompt": "1+1=", "solution": 2})
    assert problem(*dataset(train, "rollout.dataset.label_key=solution"), "eval.enabled=true",
                   f"eval.dataset={no_solution}") == (  # read with rollout.dataset's keys
        f"rollout.dataset.label_key: {no_solution}:1: no field 'solution'; fields are "
        f"['answer', 'prompt']; {LABEL_FIX}")


def test_a_large_dataset_is_checked_in_part_and_said_so(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = jsonl(tmp_path, "big.jsonl", *[GOOD] * 3000)
    monkeypatch.setattr("rollout.datasets.CHECK_MAX_BYTES", 4096)
    [note] = preflight(parse_job_config("", dataset(path)))
    assert note.startswith("rollout.dataset.path: checked the first ") and note.endswith(
        "; the rest is checked as the job reads it")


def test_custom_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "syntax_rewards.py").write_text("def score(:\n")
    (tmp_path / "other_rewards.py").write_text("def other(r, l, m):\n    return [0.0] * len(r)\n")
    (tmp_path / "needs_dep.py").write_text("import not_installed_dep\n")
    reward = ["rollout.reward.type=custom"]
    field = "rollout.reward.custom_function"
    assert problem(*reward, f"{field}=missing_rewards:score") == \
        f"{field}: cannot import module 'missing_rewards': {NOT_ON_PATH}"
    assert problem(*reward, f"{field}=syntax_rewards:score") == (
        f"{field}: cannot import module 'syntax_rewards': SyntaxError: invalid syntax "
        "(syntax_rewards.py, line 1)")
    assert problem(*reward, f"{field}=other_rewards:score") == \
        f"{field}: module 'other_rewards' has no callable 'score' (it defines: other)"
    assert problem(*reward, f"{field}=needs_dep:score") == (
        f"{field}: cannot import module 'needs_dep': it needs 'not_installed_dep', which is "
        "not installed here")
    assert problem("aggregation.custom_reducer=missing_reducers:weights") == \
        f"aggregation.custom_reducer: cannot import module 'missing_reducers': {NOT_ON_PATH}"
    assert problem("aggregation.custom_reducer=other_rewards:weights") == (
        "aggregation.custom_reducer: module 'other_rewards' has no callable 'weights' "
        "(it defines: other)")
    critic = ["rollout.advantage.type=gae", "critic.enabled=true"]
    assert problem(*critic, "critic.custom_reducer=missing_reducers:weights") == \
        f"critic.custom_reducer: cannot import module 'missing_reducers': {NOT_ON_PATH}"
    ok = ["aggregation.custom_reducer=tests.trainer.reducers:discounted_group_mean",
          *reward, f"{field}=tests.rollout.reward_fns:length_reward"]
    assert preflight(parse_job_config("", ok)) == []


def test_a_checked_module_leaves_no_trace(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller checks at every submit: a module fixed since is read again."""
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "fixed_later.py"
    module.write_text("def other():\n    pass\n")
    with pytest.raises(ValueError, match="has no callable 'score'"):
        check_object("fixed_later:score", "f")
    assert "fixed_later" not in sys.modules
    module.write_text("def score():\n    pass\n")
    check_object("fixed_later:score", "f")
    assert "fixed_later" not in sys.modules


def test_model_folders_and_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    assert problem(f"rollout.model={folder}") == (
        f"rollout.model: {folder} is an empty folder; a model folder holds config.json, "
        f"*.safetensors weights and tokenizer files: {HINT}")
    (folder / "notes.txt").write_text("x")
    assert problem(f"rollout.model={folder}") == (
        f"rollout.model: {folder} has no config.json, so it is no Hugging Face model folder "
        f"(it holds notes.txt); {HINT}")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    assert problem(f"rollout.model={folder}") == \
        f"rollout.model: {folder} has no weights (*.safetensors); {HINT}"
    (folder / "model.safetensors").write_bytes(b"")
    assert problem(f"rollout.model={folder}") == (
        f"rollout.model: {folder} has no tokenizer files (tokenizer.json or tokenizer.model); "
        "save the tokenizer there, or name a tokenizer folder in rollout.tokenizer")
    assert problem(f"rollout.model={folder}", f"rollout.tokenizer={tmp_path}") == (
        f"rollout.tokenizer: {tmp_path} has no tokenizer files (tokenizer.json or "
        "tokenizer.model)")
    (folder / "tokenizer.json").write_text("{}")
    assert preflight(parse_job_config("", [f"rollout.model={folder}"])) == []
    monkeypatch.chdir(tmp_path)
    assert problem("rollout.model=llama-7b") == (
        f"rollout.model: 'llama-7b' is neither a built-in model nor a local folder (looked for "
        f"{tmp_path / 'llama-7b'}); built-in models: tiny, smollm2-135m-instruct; or name a "
        "Hugging Face model folder (Tally does not download models)")


def test_prompt_and_generation_budgets_past_the_context(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 64}')
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    assert problem(f"rollout.model={folder}", "rollout.max_prompt_tokens=40",
                   "rollout.sampling.max_new_tokens=32") == (
        "rollout.max_prompt_tokens: 40 + sampling.max_new_tokens 32 = 72 > the model's "
        "context 64; lower one of them")
    assert problem(f"rollout.model={folder}", "rollout.sampling.max_new_tokens=64") == (
        "rollout.sampling.max_new_tokens: 64 = the model's context 64, leaving no room for "
        "a prompt; set it below 64")
    assert preflight(parse_job_config("", [f"rollout.model={folder}",
                                           "rollout.max_prompt_tokens=32",
                                           "rollout.sampling.max_new_tokens=32"])) == []


def test_budgets_of_a_built_in_model_are_checked_against_its_context() -> None:
    """The tiny model's context is 256: an episode budget of 512 cannot fit, with its
    field named, before anything is built; SmolLM2's 8192 holds it. The default budget
    is the model's context: it fits, and is the constant mode's max_response_len."""
    env = "rollout.environment.class_path=rollout.environments.guess_number:GuessNumber"
    assert problem(env, "rollout.environment.max_total_tokens=512") == (
        "rollout.environment.max_total_tokens: 512 > the model's context 256, leaving no "
        "room for a prompt; set it below 256")
    assert preflight(parse_job_config("", [env])) == []
    assert parse_job_config("", [env]).max_response_len == 256
    assert parse_job_config("", [env, "rollout.model=smollm2-135m-instruct"]
                            ).max_response_len == 8192
    assert problem("rollout.sampling.max_new_tokens=300") == (
        "rollout.sampling.max_new_tokens: 300 > the model's context 256, leaving no room "
        "for a prompt; set it below 256")
    assert preflight(parse_job_config("", [env, "rollout.environment.max_total_tokens=64"])
                     ) == []


def test_gpus_on_a_head_tally_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU here, whatever the machine
    monkeypatch.setattr("services.runtime.placement.local_head_cpus", lambda config: 4)
    start = time.monotonic()
    assert problem("trainer.num_gpus_per_rank=1", local_head=True) == (
        f"trainer.num_gpus_per_rank: 1 GPU per rank asked for, {NO_GPU}; set it to 0 or join "
        "a cluster with --address")
    assert time.monotonic() - start < 1.0
    assert problem("rollout.engine.device=cuda", local_head=True) == (
        f"rollout.engine.device: cuda asked for, {NO_GPU}; set it to cpu or join a cluster "
        "with --address")
    assert problem('trainer.resources={"node:a": 1}', local_head=True) == (
        "trainer.resources: asks for 'node:a', which this machine does not have (Ray head "
        "started by Tally: 4 CPUs, 0 GPUs); remove it or join a cluster with --address")
    # A cluster may still get the GPU: no check (the controller's submit, RAY_ADDRESS).
    assert preflight(parse_job_config("", ["trainer.num_gpus_per_rank=1"])) == []


def test_more_gpus_than_the_machine_names_the_field_that_tips_it() -> None:
    def refused(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            check_local_head(parse_job_config("", list(overrides)), num_cpus=8, num_gpus=2)
        return str(info.value)

    has = "this machine has only 2 GPUs (Ray head started by Tally: 8 CPUs, 2 GPUs)"
    assert refused("trainer.dp_size=4", "trainer.num_gpus_per_rank=1") == (
        f"trainer.num_gpus_per_rank: 1 GPU per rank asked for (4 ranks: 4 GPUs), but {has}; "
        "lower it (or trainer.dp_size), or join a cluster with --address")
    assert refused("trainer.dp_size=2", "trainer.num_gpus_per_rank=1",
                   "rollout.engine.num_gpus=1") == (
        "rollout.engine.num_gpus: 1 GPU per engine asked for (1 engine and 2 for the trainer: "
        f"3 GPUs in all), but {has}; set rollout.engine.num_gpus to 0 or join a cluster with "
        "--address")
    check_local_head(parse_job_config("", ["trainer.num_gpus_per_rank=1",
                                           "rollout.engine.num_gpus=1"]), num_gpus=2)  # fits
    with pytest.raises(ConfigError, match=r"^rollout\.engine\.num_cpus: 4 CPUs per engine "
                       r"asked for \(17 CPUs in all with the trainer ranks\), but this machine "
                       r"has 8 \(Ray head"):
        check_local_head(parse_job_config("", ["rollout.engine.num_engines=4",
                                               "rollout.engine.num_cpus=4"]), num_cpus=8)


def test_a_local_head_is_started_only_without_an_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert starts_local_head() == ("ray" not in sys.modules
                                   or not sys.modules["ray"].is_initialized())
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert not starts_local_head()


def test_preflight_imports_neither_torch_nor_ray(tmp_path: Path) -> None:
    """The controller runs it at submit; `tally train` before Ray starts."""
    broken = jsonl(tmp_path, "d.jsonl", "{")
    code = (
        "import sys\n"
        "from services.config.job import ConfigError, parse_job_config\n"
        "from services.runtime.preflight import preflight\n"
        "for overrides in (['trainer.num_gpus_per_rank=1'],\n"
        f"                  ['rollout.dataset.type=jsonl', 'rollout.dataset.path={broken}']):\n"
        "    try:\n"
        "        preflight(parse_job_config('', overrides), local_head=True)\n"
        "    except ConfigError:\n"
        "        pass\n"
        "print(sorted({'torch', 'ray', 'transformers'} & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env={"PATH": "", "CUDA_VISIBLE_DEVICES": ""}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_teacher_is_named_where_it_cannot_load_or_speaks_another_vocabulary(
        tmp_path: Path) -> None:
    """Distillation's teacher scores the policy's token ids: a teacher of another
    vocabulary is refused before anything starts, naming the field it came from, and so
    is one that is no model; one of the policy's family passes."""
    from rollout.tiny import create_tiny_checkpoint

    assert problem("rollout.teacher.model=smollm2-135m-instruct") == (
        "rollout.teacher.model: smollm2-135m-instruct's tokenizer is not the policy's "
        "(tiny): the teacher scores the policy's token ids, so both need one vocabulary "
        "(distil from a teacher of the same family)")
    assert problem("rollout.advantage.type=distill",
                   "rollout.advantage.teacher=smollm2-135m-instruct").startswith(
        "rollout.advantage.teacher: smollm2-135m-instruct's tokenizer is not the policy's")
    missing = tmp_path / "nope"
    assert problem(f"rollout.teacher.model={missing}").startswith(
        f"rollout.teacher.model: '{missing}' is neither a built-in model nor a local folder")
    teacher = create_tiny_checkpoint(tmp_path / "teacher", seed=3)
    assert preflight(parse_job_config("", [f"rollout.teacher.model={teacher}"])) == []


def test_a_critic_model_of_another_vocabulary_or_no_model_is_named(tmp_path: Path) -> None:
    """A critic of its own values the policy's token ids: one of another vocabulary, or no
    model at all, is refused naming critic.model; one of the policy's family passes."""
    from rollout.tiny import create_tiny_checkpoint

    ppo = ["rollout.advantage.type=gae", "critic.enabled=true"]
    assert problem(*ppo, "critic.model=smollm2-135m-instruct").startswith(
        "critic.model: smollm2-135m-instruct's tokenizer is not the policy's (tiny)")
    assert problem(*ppo, f"critic.model={tmp_path / 'nope'}").startswith(
        f"critic.model: '{tmp_path / 'nope'}' is neither a built-in model nor a local folder")
    critic = create_tiny_checkpoint(tmp_path / "critic", seed=5)
    assert preflight(parse_job_config("", [*ppo, f"critic.model={critic}"])) == []


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.advantage.type=distill"],
     "rollout.advantage: teacher: type distill needs a teacher model"),
    (["rollout.advantage.teacher=tiny"],
     "rollout.advantage: teacher: only applies to type=distill, not type=grpo (a teacher "
     "beside another type: rollout.teacher)"),
    (["rollout.advantage.type=distill", "rollout.advantage.teacher=tiny",
      "rollout.teacher.model=tiny"],
     "rollout: teacher: advantage.type distill names its own teacher (advantage.teacher); "
     "rollout.teacher adds one to another type"),
    (["rollout.teacher.model=tiny", "rollout.teacher.coef=0"],
     "rollout.teacher.coef: Input should be greater than 0"),
])
def test_a_teacher_config_that_cannot_mean_one_thing_is_refused(
        overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_job_config("", overrides)
    assert message in str(info.value)


def _reward_problem(parts: list[dict]) -> str:
    text = json.dumps({"rollout": {"reward": parts}})
    with pytest.raises(ConfigError) as info:
        preflight(parse_job_config(text))
    assert len(info.value.problems) == 1, str(info.value)
    return str(info.value)


def test_reward_model_folders_are_checked_before_anything_starts(tmp_path: Path) -> None:
    """A reward model is a one-label sequence classifier with a tokenizer: a causal LM, a
    classifier of two labels, a folder without tokenizer files are refused, naming the
    part (rollout.reward[1].path)."""
    from rollout.tiny import resolve_model_path
    from tests.reward_model_folders import save_random_reward_model

    tiny = resolve_model_path("tiny")
    rule = {"type": "exact_match"}
    message = _reward_problem([rule, {"type": "model", "path": tiny}])
    assert message.startswith(f"rollout.reward[1].path: {tiny} has no sequence-"
                              "classification head (architectures ['Qwen2ForCausalLM'])")
    two = save_random_reward_model(tmp_path / "two", tiny, num_labels=2)
    assert _reward_problem([rule, {"type": "model", "path": two}]) == (
        f"rollout.reward[1].path: {two} has num_labels=2; a reward model has one label "
        "(its score)")
    bare = Path(save_random_reward_model(tmp_path / "bare", tiny))
    for name in bare.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "vocab", "chat_template")):
            name.unlink()
    assert _reward_problem([{"type": "model", "path": str(bare)}]).startswith(
        f"rollout.reward[0].path: no tokenizer in {bare}")
    pickled = Path(save_random_reward_model(tmp_path / "pickled", tiny))
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    assert _reward_problem([rule, {"type": "model", "path": str(pickled)}]) == (
        f"rollout.reward[1].path: {pickled} has no *.safetensors weights; Tally reads "
        "weights as safetensors only, never a pickle (save_pretrained writes them)")
    good = save_random_reward_model(tmp_path / "good", tiny)
    plain = Path(save_random_reward_model(tmp_path / "plain", tiny))
    (plain / "chat_template.jinja").unlink()
    assert _reward_problem([{"type": "model", "path": str(plain), "chat_template": True}]) \
        == f"rollout.reward[0].chat_template: the tokenizer of {plain} has no chat template"
    preflight(parse_job_config(json.dumps({"rollout": {"reward": [
        rule, {"type": "model", "path": good, "name": "rm"}]}})))  # passes


def test_judge_and_list_refusals_name_the_part() -> None:
    def refused(parts: list[dict]) -> str:
        with pytest.raises(ConfigError) as info:
            parse_job_config(json.dumps({"rollout": {"reward": parts}}))
        return str(info.value)

    rule = {"type": "exact_match"}
    assert refused([rule, {"type": "judge", "template": "grade {prompt}"}]) == (
        "<config>: rollout.reward[1]: template: has no {response}; the judge would not see "
        "the answer it grades")
    assert refused([rule, {"type": "judge", "parse": r"Score: \d+"}]) == (
        "<config>: rollout.reward[1]: parse: 'Score: \\\\d+' has no group; its first group "
        "is the score, e.g. 'Score: ([0-9.]+)'")
    assert refused([rule, {"type": "judge", "template": "{response} {answer}"}]).startswith(
        "<config>: rollout.reward[1]: template: only {prompt}, {response} and {label}")
    assert refused([rule, {"type": "model"}]) == "<config>: rollout.reward[1].path: Field required"
    assert refused([rule, rule]) == ("<config>: rollout: reward[1].name: 'exact_match' is "
                                     "also reward[0]'s name; give each part its own")
    assert refused([]) == "<config>: rollout: reward: an empty list; give at least one reward"
    with pytest.raises(ConfigError) as info:
        preflight(parse_job_config(json.dumps({"rollout": {"reward": [
            rule, {"type": "judge", "model": "/no/such/judge"}]}})))
    assert str(info.value).startswith("rollout.reward[1].model: '/no/such/judge' is neither")


@pytest.mark.parametrize(("part", "field"), [
    ({"type": "model", "path": "MISSING"}, "rollout.reward[1].path"),
    ({"type": "model", "path": "someorg/some-rm"}, "rollout.reward[1].path"),
    ({"type": "model", "path": "TMP", "tokenizer": "someorg/tok"},
     "rollout.reward[1].tokenizer"),
], ids=["missing-folder", "hub-style", "hub-style-tokenizer"])
def test_a_reward_model_that_is_no_local_folder_is_refused_offline(
        tmp_path: Path, part: dict, field: str) -> None:
    """A folder not made yet (or ``org/name``) is never handed to transformers, which
    would take it for a hub id and retry for most of a minute: refused at once, naming
    the field, without transformers (or huggingface_hub) even imported. Run with the
    hub allowed by the environment: preflight itself must not reach it."""
    part = {k: v.replace("MISSING", str(tmp_path / "rm")).replace("TMP", str(tmp_path))
            for k, v in part.items()}
    config = json.dumps({"rollout": {"reward": [{"type": "exact_match"}, part]}})
    code = (
        "import sys\n"
        "from services.config.job import ConfigError, parse_job_config\n"
        "from services.runtime.preflight import preflight\n"
        "try:\n"
        f"    preflight(parse_job_config({config!r}))\n"
        "except ConfigError as err:\n"
        "    print(err)\n"
        "print(sorted({'transformers', 'huggingface_hub'} & set(sys.modules)))\n")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env={"PATH": "", "HF_HUB_OFFLINE": "0"}, timeout=60)
    elapsed = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    message, imported = out.stdout.strip().splitlines()
    value = part["tokenizer" if field.endswith("tokenizer") else "path"]
    assert message == (f"{field}: {value} does not exist; name a local "
                       f"{'tokenizer' if field.endswith('tokenizer') else 'reward-model'} "
                       "folder (Tally does not download models)")
    assert imported == "[]"
    assert elapsed < 30, f"{elapsed:.0f} s"  # loose: a subprocess on a busy machine
