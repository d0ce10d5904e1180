"""A new user's first hour: every broken input below is refused before anything starts.

`tally train` (a real subprocess, the installed command) exits 2 in under 10 s with one
line on stderr naming the field or file:line, starts no Ray process and writes nothing to
the jobs folder; `tally submit` answers 422 with the same line (the controller runs the
same preflight) and stores nothing. tests/services/runtime/test_preflight.py has each check's
message on its own."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from services.cli import app as cli
from services.config.job import parse_job_config
from services.controller.app import create_app
from services.runtime.preflight import preflight
from tests.services.controller.fakes import FakeBackend, api_client, make_settings, serve_in_thread
from tests.services.runtime.test_preflight import HINT, LABEL_FIX, NOT_ON_PATH

ROOT = Path(__file__).resolve().parents[2]
TALLY = Path(sys.executable).parent / "tally"
BASE = """\
name: first-hour
num_steps: 1
rollout:
  model: tiny
  dataset: {type: jsonl, path: INPUTS/good.jsonl}
  n_samples_per_prompt: 4
  global_batch_size: 8
"""
RECORD = {"prompt": "2+2=", "answer": 4}
NO_GPU = (r"but this machine has no GPU \(Ray head started by Tally: \d+ CPUs, 0 GPUs\); "
          r"set it to {} or join a cluster with --address")

# (id, --set overrides, the one line: text or "re:" pattern, what submit answers: "same"
# line, or "field" only (the controller's own path checks speak first), or None: not
# refused at submit, a cluster may have what this machine lacks)
CASES = [
    ("missing-dataset", ["rollout.dataset.path=INPUTS/nope.jsonl"],
     "rollout.dataset.path: INPUTS/nope.jsonl does not exist or is not a file", "field"),
    ("empty-dataset", ["rollout.dataset.path=INPUTS/empty.jsonl"],
     "rollout.dataset.path: INPUTS/empty.jsonl has no records (empty file); a JSONL file "
     "holds one JSON object per line", "same"),
    ("invalid-json", ["rollout.dataset.path=INPUTS/broken.jsonl"],
     "rollout.dataset.path: INPUTS/broken.jsonl:10: invalid JSON (Expecting ',' delimiter at "
     "column 19); each line holds one JSON object", "same"),
    ("missing-prompt", ["rollout.dataset.path=INPUTS/no_prompt.jsonl"],
     "rollout.dataset.prompt_key: INPUTS/no_prompt.jsonl:3: no field 'prompt'; fields are "
     "['answer', 'question']; set prompt_key to the field holding the prompt", "same"),
    ("missing-answer", ["rollout.dataset.path=INPUTS/no_answer.jsonl"],
     "rollout.dataset.label_key: INPUTS/no_answer.jsonl:17: no field 'label' or 'answer' (the "
     f"default label fields); fields are ['prompt', 'solution']; {LABEL_FIX}", "same"),
    ("reward-module-missing", ["rollout.reward.type=custom",
                               "rollout.reward.custom_function=no_such_rewards:score"],
     f"rollout.reward.custom_function: cannot import module 'no_such_rewards': {NOT_ON_PATH}",
     "same"),
    ("reward-module-broken", ["rollout.reward.type=custom",
                              "rollout.reward.custom_function=first_hour_broken:score"],
     "rollout.reward.custom_function: cannot import module 'first_hour_broken': SyntaxError: "
     "invalid syntax (first_hour_broken.py, line 1)", "same"),
    ("reward-function-missing", ["rollout.reward.type=custom",
                                 "rollout.reward.custom_function=first_hour_rewards:score"],
     "rollout.reward.custom_function: module 'first_hour_rewards' has no callable 'score' "
     "(it defines: other)", "same"),
    ("reducer-module-missing", ["aggregation.custom_reducer=no_such_reducers:weights"],
     f"aggregation.custom_reducer: cannot import module 'no_such_reducers': {NOT_ON_PATH}",
     "same"),
    ("empty-model-folder", ["rollout.model=INPUTS/empty_model"],
     "rollout.model: INPUTS/empty_model is an empty folder; a model folder holds config.json, "
     f"*.safetensors weights and tokenizer files: {HINT}", "same"),
    ("incomplete-model-folder", ["rollout.model=INPUTS/part_model"],
     f"rollout.model: INPUTS/part_model has no weights (*.safetensors); {HINT}", "same"),
    ("unknown-model", ["rollout.model=llama-7b"],
     "rollout.model: 'llama-7b' is neither a built-in model nor a local folder (looked for "
     "CWD/llama-7b); built-in models: tiny, smollm2-135m-instruct; or name a Hugging Face "
     "model folder (Tally does not download models)", "field"),
    ("eval-dataset", ["eval.enabled=true", "eval.dataset.type=jsonl",
                      "eval.dataset.path=INPUTS/broken.jsonl"],
     "eval.dataset.path: INPUTS/broken.jsonl:10: invalid JSON (Expecting ',' delimiter at "
     "column 19); each line holds one JSON object", "same"),
    ("gpu-per-rank", ["trainer.num_gpus_per_rank=1"],
     "re:trainer\\.num_gpus_per_rank: 1 GPU per rank asked for, " + NO_GPU.format(0), None),
    ("cuda-engine", ["rollout.engine.device=cuda"],
     "re:rollout\\.engine\\.device: cuda asked for, " + NO_GPU.format("cpu"), None),
]


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """The broken inputs, inside the data folder (the controller reads only there)."""
    folder = tmp_path / "data" / "inputs"
    folder.mkdir(parents=True)

    def lines(name: str, *records: object) -> None:
        (folder / name).write_text("".join(
            (r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))

    lines("good.jsonl", *[RECORD] * 8)
    lines("empty.jsonl")
    lines("broken.jsonl", *[RECORD] * 9, '{"prompt": "3+3=" "answer": 6}')
    lines("no_prompt.jsonl", RECORD, RECORD, {"question": "1+1=", "answer": 2})
    lines("no_answer.jsonl", *[RECORD] * 16, {"prompt": "1+1=", "solution": 2})
    (folder / "first_hour_broken.py").write_text("def score(:\n")
    (folder / "first_hour_rewards.py").write_text("def other(r, l, m):\n    return [0.0]\n")
    (folder / "empty_model").mkdir()
    (folder / "part_model").mkdir()
    (folder / "part_model" / "config.json").write_text('{"model_type": "qwen2"}')
    (folder / "part_model" / "tokenizer.json").write_text("{}")
    (tmp_path / "job.yaml").write_text(BASE.replace("INPUTS", str(folder)))
    return folder


def expected(line: str, inputs: Path, cwd: Path) -> str:
    return line.replace("INPUTS", str(inputs)).replace("CWD", str(cwd))


def matches(line: str, want: str) -> bool:
    return bool(re.fullmatch(want[3:], line)) if want.startswith("re:") else line == want


@pytest.fixture
def ray_tmpdir() -> Iterator[Path]:
    """Where a Ray head started by the command would put its session: short (Unix socket
    paths are limited), and this test's own, so a Ray that other tests start meanwhile is
    never mistaken for one started here."""
    folder = Path(tempfile.mkdtemp(prefix="tally-fh-", dir="/tmp"))
    yield folder / "ray"
    shutil.rmtree(folder, ignore_errors=True)


def ray_processes(marker: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or ())
        except psutil.Error:
            continue
        if proc.info["name"] in ("raylet", "gcs_server") and marker in cmdline:
            found.append(f"{proc.pid} {proc.info['name']}")
    return found


def test_the_base_config_passes(inputs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each case breaks one thing of a config that is otherwise fine."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    config = parse_job_config((inputs.parent.parent / "job.yaml").read_text())
    assert preflight(config, local_head=True) == []


@pytest.mark.parametrize(("overrides", "line"), [(c[1], c[2]) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_tally_train_refuses_in_one_line_and_starts_nothing(
        inputs: Path, ray_tmpdir: Path, overrides: list[str], line: str) -> None:
    data, cwd = inputs.parent, inputs.parent.parent
    env = {**os.environ, "TALLY_DATA_DIR": str(data), "RAY_TMPDIR": str(ray_tmpdir),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(inputs), os.environ.get(
               "PYTHONPATH")))), "PYTHONDONTWRITEBYTECODE": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever the host
    env.pop("RAY_ADDRESS", None)
    sets = [arg for o in overrides for arg in ("--set", o.replace("INPUTS", str(inputs)))]
    before = sorted(str(p) for p in data.rglob("*"))
    start = time.monotonic()
    done = subprocess.run([str(TALLY), "train", str(cwd / "job.yaml"), *sets], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1, done.stderr[-3000:]  # one line, no traceback
    assert matches(done.stderr.rstrip("\n"), expected(line, inputs, cwd)), done.stderr
    assert elapsed < 10, f"{elapsed:.1f} s"
    assert not (data / "jobs").exists()
    assert sorted(str(p) for p in data.rglob("*")) == before  # nothing written at all
    assert not ray_tmpdir.exists() and not ray_processes(str(ray_tmpdir))


SUBMITTED = [c for c in CASES if c[3] is not None]


@pytest.mark.parametrize(("overrides", "line", "answer"), [c[1:] for c in SUBMITTED],
                         ids=[c[0] for c in SUBMITTED])
def test_tally_submit_answers_422_with_the_same_line_and_stores_nothing(
        inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str],
        line: str, answer: str) -> None:
    monkeypatch.syspath_prepend(str(inputs))  # the modules, importable as for the job
    monkeypatch.chdir(tmp_path)
    api = api_client(tmp_path)
    text = (tmp_path / "job.yaml").read_text()
    start = time.monotonic()
    response = api.post("/api/jobs", json={"config_yaml": text, "overrides": [
        o.replace("INPUTS", str(inputs)) for o in overrides]})
    assert time.monotonic() - start < 10
    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    field = expected(line, inputs, tmp_path).split(": ", 1)[0]
    if answer == "same":
        assert f"{error['field']}: {error['message']}" == expected(line, inputs, tmp_path)
    else:
        assert error["field"] == field, error
    jobs_dir = api.ctl.settings.jobs_dir
    assert not jobs_dir.exists() or not any(jobs_dir.iterdir())
    assert api.get("/api/jobs").json()["items"] == []


def test_the_submit_command_exits_2_naming_the_field(inputs: Path, tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path), backend=FakeBackend())  # data: tmp_path/data
    with serve_in_thread(app) as url:
        result = CliRunner().invoke(cli, ["submit", str(tmp_path / "job.yaml"), "--url", url,
                                          "--set", f"rollout.dataset.path={inputs}/broken.jsonl"])
    assert result.exit_code == 2, result.output
    assert (f"rollout.dataset.path: {inputs}/broken.jsonl:10: invalid JSON (Expecting ',' "
            "delimiter at column 19); each line holds one JSON object") in result.output


def test_rays_token_auth_notice_is_dropped_and_nothing_else() -> None:
    """Ray logs it on every head ray.init starts; the head keeps its token auth."""
    from ray._private.authentication import authentication_token_setup as ray_auth

    from services.runtime.gang import _drop_token_auth_notice

    _drop_token_auth_notice()
    _drop_token_auth_notice()  # once is enough: a second call adds no second filter
    logger = logging.getLogger(ray_auth.__name__)
    assert len(logger.filters) == 1
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        ray_auth._warn_token_auth_enabled()  # Ray's own notice, in its own words
        ray_auth._warn_token_auth_disabled()  # a real warning: kept
    finally:
        logger.removeHandler(handler)
    assert [message[:48] for message in seen] == [
        "Token authentication is disabled for this Ray cl"]


def test_a_refused_train_imports_neither_torch_nor_ray(inputs: Path) -> None:
    """What makes a refusal fast: the driver (torch, Ray, transformers) is imported only
    once every check passed."""
    code = ("import sys\n"
            "from services.cli import app\n"
            "try:\n"
            "    app(sys.argv[1:])\n"
            "except SystemExit as done:\n"
            "    print(done.code, sorted({'torch', 'ray', 'transformers'} & set(sys.modules)))\n")
    done = subprocess.run(
        [sys.executable, "-c", code, "train", str(inputs.parent.parent / "job.yaml"), "--set",
         f"rollout.dataset.path={inputs}/broken.jsonl"], cwd=ROOT, capture_output=True,
        text=True, timeout=60, env={**os.environ, "TALLY_DATA_DIR": str(inputs.parent)})
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr[-2000:]
