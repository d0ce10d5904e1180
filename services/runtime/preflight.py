"""Checks a job needs before anything starts that pydantic cannot see: optional packages;
local paths and what they hold (every record of a dataset file, bounded in time; the model
folder); the user's own modules (``rollout.reward.custom_function``,
``rollout.environment.class_path``, ``aggregation.custom_reducer``: located at submit,
imported only in the job); the token budget
within the model's context (rollout/token_budget.py); and, for a Ray head
Tally starts itself, the machine's CPUs and GPUs. The controller runs them at submit
time, ``tally train`` before Ray starts and the driver again at start.

Free of torch and Ray, so the controller stays light: only the local-head check may import
torch, lazily, on a machine with a GPU device. Each problem is one line that names the
field (and the file:line for a dataset record) and how to fix it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from rollout.config import DatasetConfig
from rollout.datasets import check_prompt_dataset
from rollout.engines import check_engine_available
from rollout.environments import load_environment_class
from rollout.plugins import check_object, locate_object
from rollout.pretrained import (
    BUILTIN_MODELS,
    SMOLLM2_NAME,
    check_model,
    require_gguf,
    same_vocabulary,
    smollm2_gguf_path,
    tokenizer_vocabulary,
)
from rollout.reward_parts import RewardPart, build_parts
from services.config.job import ConfigError, ConfigProblem, JobConfig
from services.driver.wandb_sink import check_wandb_available
from services.runtime.placement import check_local_head
from trainer.config import POLICY_LOSS_CLASS_PATH_FIELD, LossConfig

# No hub call, ever: a name that is no local folder is refused by the checks below
# before transformers sees it; this is the guard behind them. huggingface_hub reads it
# once, at its import, which none of the imports above makes.
os.environ["HF_HUB_OFFLINE"] = "1"

CHECKED = (RuntimeError, ValueError)
"""What a check raises, its message ``field: …`` within its section: DatasetError and
PluginError (ValueErrors), ModelImportError and EngineUnavailableError (RuntimeErrors)."""


def preflight(config: JobConfig, local_head: bool = False,
              load_user_code: bool = False) -> list[str]:
    """Raises ConfigError (source "": the config is already parsed) with one problem per
    failed check, each naming its field. Returns notes, one line each, on what was checked
    only in part (a dataset file too large to read whole in the time allowed).

    ``local_head``: the job runs on a Ray head started here (``tally train`` without
    ``--address`` / ``RAY_ADDRESS``; services.runtime.placement.starts_local_head), so a job that
    head could never place is refused instead of waiting forever. Never at submit: a
    cluster's nodes may still join.

    ``load_user_code``: import the user's modules and check what they name (in the job:
    services/train.py, the driver); else each is located without running any of its
    code (the controller at submit): :func:`_user_code`.
    """
    problems: list[ConfigProblem] = []
    notes: list[str] = []

    def check(section: str, run: Callable[[], object]) -> None:
        try:
            run()
        except ConfigError as err:  # already names its whole field
            problems.extend(err.problems)
        except CHECKED as err:
            problems.append(ConfigProblem.from_rule(str(err), section))

    check("rollout", lambda: check_engine_available(config.rollout))
    check("rollout", lambda: _check_model(config))
    check("", lambda: _check_context(config))
    check("", lambda: _check_rewards(config))
    if config.rollout.distillation is not None:
        check("", lambda: _check_teacher(config))
    if config.critic.enabled and config.critic.model is not None:
        check("", lambda: _check_critic(config))
    for user_check in [*_user_code(config, load_user_code),
                       *_reward_code(config, load_user_code)]:
        check("", user_check)
    if config.rollout.advantage.class_path is not None:
        check("", partial(_check_advantage_class, config, load_user_code))
    if config.trainer.loss.class_path is not None:
        check("", partial(_check_policy_loss_class, config.trainer.loss, load_user_code))
    check("", lambda: check_wandb_available(config.logging.wandb))
    if config.trainer.backend == "megatron":
        check("", lambda: _check_megatron(config))
    if config.trainer.lora is not None:
        check("", lambda: _check_lora(config))
    if local_head:
        check("", lambda: check_local_head(config))
    check("rollout", lambda: _check_dataset(config.rollout.dataset, "rollout", notes))
    if config.eval.enabled and config.eval.dataset is not None:  # else: rollout.dataset's
        num_checked = len(problems)
        check("eval", lambda: _check_dataset(config.eval_dataset(), "eval", notes))
        if isinstance(config.eval.dataset, str):  # `eval.dataset: held.jsonl`
            keys_from = "rollout.dataset" if hasattr(config.rollout.dataset, "path") else None
            problems[num_checked:] = [_eval_path_problem(p, keys_from)
                                      for p in problems[num_checked:]]
    if problems:
        raise ConfigError("", problems)
    return notes


def _user_code(config: JobConfig, load: bool) -> list[Callable[[], object]]:
    """One check per ``module:attr`` of the user's (``rollout.environment.class_path``,
    ``aggregation.custom_reducer``, ``critic.custom_reducer``; the reward parts':
    :func:`_reward_code`). ``load``: imported and checked for what it must be (an
    environment a subclass of rollout.environments.Environment, the rest callables): user
    code runs in the job only.
    Else located and parsed, never run: the controller imports no user module."""
    named: list[tuple[str, str, bool]] = []  # the reward parts': _reward_code
    if config.rollout.environment is not None:
        named.append((config.rollout.environment.class_path,
                      "rollout.environment.class_path", True))
    if config.aggregation.custom_reducer is not None:
        named.append((config.aggregation.custom_reducer, "aggregation.custom_reducer", False))
    if config.critic.enabled and config.critic.custom_reducer is not None:
        named.append((config.critic.custom_reducer, "critic.custom_reducer", False))
    if load:
        return [partial(load_environment_class if is_env else check_object, path, field)
                for path, field, is_env in named]
    return [partial(locate_object, path, field, want_class=is_env)
            for path, field, is_env in named]


def _check_advantage_class(config: JobConfig, load: bool) -> None:
    """``rollout.advantage.class_path``: located at submit; in the job imported, a
    subclass of AdvantageEstimator, constructed with ``kwargs``, and what it declares it
    needs is in the job (torch is imported only here, in the job)."""
    path, field = config.rollout.advantage.class_path, "rollout.advantage.class_path"
    assert path is not None
    if not load:
        locate_object(path, field)
        return
    from rollout.advantages import GAE, build_estimator

    estimator = build_estimator(config.rollout.advantage)
    if estimator.needs_critic and not (config.critic.enabled and isinstance(estimator, GAE)):
        raise ValueError(f"{field}: {path} needs the critic's values: set critic.enabled "
                         "and subclass rollout.advantages.GAE (the critic trains on its "
                         "targets)")
    if estimator.needs_teacher and config.rollout.teacher is None:
        raise ValueError(f"{field}: {path} needs a teacher's log-probs: set "
                         "rollout.teacher.model")


def _check_policy_loss_class(loss: LossConfig, load: bool) -> None:
    """``trainer.loss.class_path`` (policy_loss: custom): located at submit; in the job
    imported, a subclass of trainer.losses.PolicyLoss, and built with ``kwargs`` (torch
    is imported only here, in the job)."""
    assert loss.class_path is not None
    if not load:
        locate_object(loss.class_path, POLICY_LOSS_CLASS_PATH_FIELD)
        return
    from trainer.losses import build_policy_loss

    build_policy_loss(loss)


def _check_model(config: JobConfig) -> None:
    if config.rollout.model == SMOLLM2_NAME:
        smollm2_gguf_path()  # imported into the data folder at start, once
        require_gguf()
    check_model(config.rollout.model, config.rollout.tokenizer)


def _reward_fields(config: JobConfig) -> list[tuple[str, RewardPart]]:
    """Each part of ``rollout.reward`` and its field (``rollout.reward[1]``)."""
    many = isinstance(config.rollout.reward, list)
    return [(f"rollout.reward[{k}]" if many else "rollout.reward", part)
            for k, part in enumerate(build_parts(config.rollout.reward_parts))]


def _reward_code(config: JobConfig, load: bool) -> list[Callable[[], object]]:
    """One check per reward part that runs the user's code (a function rule's
    ``custom_function``, a custom part's ``class_path``): ``load``, in the job, imports it
    and the part checks it is what it needs (a CustomReward subclass, a callable); else
    located, never run (the controller)."""
    checks: list[Callable[[], object]] = []
    for field, part in _reward_fields(config):
        code = part.user_code()
        if code is not None:
            path, key = code
            checks.append(partial(part.check_user_code, f"{field}.{key}") if load
                          else partial(locate_object, path, f"{field}.{key}"))
    return checks


def _check_rewards(config: JobConfig) -> None:
    """Each part of ``rollout.reward`` checks what it reads (a reward model's folder is
    a one-label sequence classifier with a tokenizer; a judge's model loads). The first
    problem, naming the part (``rollout.reward[1].path``)."""
    for field, part in _reward_fields(config):
        part.check(field)


def _check_teacher(config: JobConfig) -> None:
    """The teacher loads as a model, and its tokens are the policy's: it scores the
    policy's token ids, so another vocabulary would score other text."""
    teacher = config.rollout.distillation
    assert teacher is not None
    field = ("rollout.advantage.teacher" if config.rollout.advantage.teacher is not None
             else "rollout.teacher.model")  # the field that named it
    _check_policys_vocabulary(config, teacher.model, field, (
        "the teacher scores the policy's token ids, so both need one vocabulary (distil "
        "from a teacher of the same family)"))


def _check_critic(config: JobConfig) -> None:
    """A critic of its own loads as a model, and its tokens are the policy's: it values
    the policy's token ids."""
    assert config.critic.model is not None
    _check_policys_vocabulary(config, config.critic.model, "critic.model", (
        "the critic values the policy's token ids, so both need one vocabulary (leave "
        "critic.model unset for the policy's own)"))


def _check_policys_vocabulary(config: JobConfig, model: str, field: str, why: str) -> None:
    """``model`` (named by ``field``) loads as a model and its tokenizer is the policy's;
    ``why`` it must be ends the refusal."""
    from services.driver.run_dir import data_dir

    try:
        check_model(model)
    except RuntimeError as err:
        raise ValueError(f"{field}: {str(err).removeprefix('model: ')}") from None
    models = data_dir() / "models"
    policy = config.rollout.tokenizer or config.rollout.model
    if not same_vocabulary(tokenizer_vocabulary(model, models),
                           tokenizer_vocabulary(policy, models)):
        raise ValueError(f"{field}: {model}'s tokenizer is not the policy's ({policy}): {why}")


def _check_context(config: JobConfig) -> None:
    """The prompt budget plus the response budget within the model's context, for every
    model: a built-in one's context is known by name, a folder's read from config.json
    (rollout/token_budget.py)."""
    from rollout.token_budget import budget_problem, model_context

    problem = budget_problem(config.rollout, model_context(config.rollout.model))
    if problem is not None:
        raise ValueError(problem)


def _check_megatron(config: JobConfig) -> None:
    from trainer.backends.megatron import check_available

    local_model = config.rollout.model not in BUILTIN_MODELS
    check_available(config.trainer, config.rollout.model if local_model else None)


LINEAR_MODULES = {
    family: ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")}
"""The Linear modules of the decoders whose names preflight knows (by config.json's
model_type); another model's target_modules are checked when the trainer builds it."""
BUILTIN_MODEL_TYPES = {"tiny": "qwen2", SMOLLM2_NAME: "llama"}


def _check_lora(config: JobConfig) -> None:
    """peft is installed, and every trainer.lora.target_modules entry names a Linear
    module of the model (where its family is known)."""
    import importlib.util
    import json

    if importlib.util.find_spec("peft") is None:
        raise ValueError("trainer.lora: needs the peft package (pip install 'tally[lora]')")
    targets = config.trainer.lora.target_modules
    if not isinstance(targets, list):
        return
    model = config.rollout.model
    model_type = BUILTIN_MODEL_TYPES.get(model)
    if model_type is None:
        config_file = Path(model).expanduser() / "config.json"
        if not config_file.is_file():
            return  # check_model has said what the folder lacks
        model_type = json.loads(config_file.read_text()).get("model_type")
    known = LINEAR_MODULES.get(model_type or "")
    missing = [name for name in targets if known is not None and name not in known]
    if missing:
        verb = "is not a Linear module" if len(missing) == 1 else "are not Linear modules"
        raise ValueError(f"trainer.lora.target_modules: {', '.join(missing)} {verb} "
                         f"of {model_type} models (they have {', '.join(known)}; or use "
                         "all-linear)")


def _eval_path_problem(problem: ConfigProblem, keys_from: str | None) -> ConfigProblem:
    """A problem of an ``eval.dataset`` given as a path names that field, or the training
    dataset's key it is read with (prompt_key, label_key, metadata_keys)."""
    key = problem.field.removeprefix("eval.dataset").lstrip(".")
    field = f"{keys_from}.{key}" if keys_from and key not in ("", "path", "type") else \
        "eval.dataset"
    return ConfigProblem(field, problem.message)


def _check_dataset(dataset: DatasetConfig, section: str, notes: list[str]) -> None:
    checked = check_prompt_dataset(dataset)
    note = checked.note() if checked is not None else None
    if note:  # "dataset.path: checked the first … records"
        notes.append(f"{section}.{note}")
