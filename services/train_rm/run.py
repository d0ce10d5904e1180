"""``tally train-rm CONFIG``: a Bradley–Terry reward model trained on preference pairs.

    config ─► prepare: the config, the model folder, both pair files read and tokenized
              (rollout/reward_text.py); any problem is one line, exit 2, nothing started
           ─► Ray (the cluster at RAY_ADDRESS, else a local head we stop at the end)
           ─► a Gang (services/runtime/gang.py) of one role, the RewardModelGroup:
              DP ranks of FSDPRewardModelWorker (trainer/)
                 each step: P pairs ─► plan (whole pairs to ranks, micro-batches)
                            ─► −(1/P) Σ log σ(r⁺ − r⁻), gradients summed, AdamW step
                 every eval_every steps and at the end: held-out scores ─► eval/*
           ─► <output_dir>/metrics.jsonl, eval_scores.jsonl, config.yaml,
              final_model/ (weights, config.json, tokenizer, tally_reward_model.json)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rollout.preference_pairs import PreferenceDataError, read_preference_pairs
from rollout.reward_model_info import INFO_FILE
from services.config.errors import ConfigError, ConfigProblem
from services.driver.run_dir import FINAL_MODEL_DIR, METRICS_FILE  # every program's names
from services.train_rm.config import RewardModelConfig, load_reward_model_config
from services.train_rm.data import TokenizedPairs, step_indices, tokenize_pairs

RUN_CONFIG_FILE = "config.yaml"
REWARD_MODEL_INFO = INFO_FILE
"""In the final folder: how its scores are to be read (chat_template, max_length), so a
reward actor scores the ids the model was trained on (rollout/reward_model_info.py reads
it; truncation is left, the actor's default)."""


@dataclass(frozen=True)
class Prepared:
    """Everything a run needs, checked before anything starts."""

    config: RewardModelConfig
    model_path: str
    tokenizer: Any
    pad_id: int
    train: TokenizedPairs
    test: TokenizedPairs | None
    output_dir: Path
    num_steps: int


def _refused(source: str, field: str, message: str) -> ConfigError:
    return ConfigError(source, [ConfigProblem(field, message)], f"{source}: {field}: {message}")


def prepare(config_path: str | Path, overrides: list[str], output_dir: Path | None = None
            ) -> Prepared:
    """The run, ready (module docstring); ConfigError or PreferenceDataError otherwise."""
    from rollout.pretrained import ModelImportError
    from rollout.tiny import resolve_model_path
    from rollout.token_budget import model_context
    from services.driver.run_dir import job_dir

    source = str(config_path)
    config = load_reward_model_config(config_path, overrides)
    try:
        model_path = resolve_model_path(config.model)
    except (FileNotFoundError, ModelImportError) as err:
        raise _refused(source, "model", str(err).removeprefix("model: ")) from None
    context = model_context(model_path)
    if context is not None and config.max_length > context:
        raise _refused(source, "max_length", f"{config.max_length} is more than the "
                                             f"model's context of {context} tokens")
    folder = Path(output_dir) if output_dir else job_dir(config.name, config.output_dir)
    if (folder / METRICS_FILE).exists() or (folder / FINAL_MODEL_DIR).exists():
        raise _refused(source, "output_dir", f"{folder} already holds a train-rm run; "
                                             "choose another folder or remove it")
    tokenizer = reward_tokenizer(model_path)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise _refused(source, "model", f"{model_path}: its tokenizer has neither a pad "
                                        "nor an end-of-sequence token")
    margin_key = config.data.margin_key
    files = {"train": read_preference_pairs(config.data.train, "data.train", margin_key)}
    if config.data.test is not None:
        files["test"] = read_preference_pairs(config.data.test, "data.test", margin_key)
    try:
        tokenized = {name: tokenize_pairs(pairs, tokenizer, config.chat_template,
                                          config.max_length, margin_key is not None)
                     for name, pairs in files.items()}
    except ValueError as err:
        if isinstance(err, PreferenceDataError):
            raise
        raise _refused(source, "chat_template", str(err).removeprefix(
            "chat_template: ")) from None
    return Prepared(config, model_path, tokenizer, int(pad_id), tokenized["train"],
                    tokenized.get("test"), folder,
                    config.total_steps(len(tokenized["train"])))


def reward_tokenizer(model_path: str) -> Any:
    """The tokenizer transformers itself loads from the folder (what the reward actors,
    rollout/reward_model.py, and a user's AutoTokenizer read back from final_model/; for
    the tiny model's character tokenizer that is not rollout.tokenizer's loader), its pad
    token set to its EOS when it has none, as TRL does: the tokenizer's pad token and the
    model config's (the ranks set it from this id) are one, saved together. No score is
    read by it: training and serving read each sequence's last id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def rank_threads(model_path: str, world_size: int) -> int:
    """Torch threads per rank: the cores split between the ranks, one for a model too
    narrow to split (services/runtime/placement.py's rule)."""
    from services.runtime.placement import narrow_model

    if narrow_model(model_path):
        return 1
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def train_rm_from_cli(config_path: str | Path, overrides: list[str] | None = None,
                      output_dir: Path | None = None) -> int:
    """Prepare, then run: 0 when done. What goes wrong is raised for the one mapping
    (services/runtime/exit_codes.py, behind every ``tally`` command): a problem in the
    config or data is Refused (its line, exit code 2, nothing started); a rank that dies
    or a call past its timeout is Failed (one line, exit code 1)."""
    from services.runtime.exit_codes import Failed, Refused

    try:
        prepared = prepare(config_path, overrides or [], output_dir)
    except PreferenceDataError as err:  # a ConfigError the mapping knows itself
        raise Refused(str(err)) from None
    from trainer.group import TrainerRankDied  # only now Ray and torch

    try:
        run(prepared)
    except (TrainerRankDied, TimeoutError) as err:
        raise Failed(f"error: {err}") from err
    return 0


def run(prepared: Prepared, log: Any = print) -> dict[str, float]:
    """Train, evaluate and save (module docstring); the last row's metrics."""
    from services.runtime.gang import Gang, Roles, actor_env, ray_started
    from services.runtime.quiet import quiet_transformers
    from trainer.reward_model_group import RewardModelGroup

    config, out = prepared.config, prepared.output_dir
    quiet_transformers()
    trainer = config.rank_config(rank_threads(prepared.model_path, config.trainer.dp_size))
    log(f"train-rm {config.name}: {len(prepared.train)} train pairs"
        + (f", {len(prepared.test)} held out" if prepared.test else ", none held out")
        + f", {prepared.num_steps} steps of {config.pairs_per_step} pairs, model "
        f"{config.model}, dp={trainer.dp_size} packing={trainer.packing}"
        + (f" ({prepared.train.num_truncated} train texts cut to max_length "
           f"{config.max_length})" if prepared.train.num_truncated else ""))
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_CONFIG_FILE).write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))

    def reward_model(_placement: object) -> RewardModelGroup:
        return RewardModelGroup(trainer, prepared.model_path, prepared.num_steps,
                                prepared.pad_id, env_vars=actor_env(),
                                center_rewards_coefficient=config.center_rewards_coefficient)

    # its own ranks only, where Ray puts them: a train-rm run has no job config to place
    roles = Roles(policy=reward_model, place=False)
    with (ray_started(max(os.cpu_count() or 1, trainer.world_size + 1)),
          Gang(None, prepared.model_path, roles) as gang):
        row = _train(gang.trainer, prepared, log)
        _save(gang.trainer, prepared, out / FINAL_MODEL_DIR)
    log(f"final model: {out / FINAL_MODEL_DIR}")
    return row


def _train(group: Any, prepared: Prepared, log: Any) -> dict[str, float]:
    from services.driver.sinks import JsonlSink
    from services.train_rm.report import (
        EVAL_SCORES_FILE,
        eval_summary,
        held_out_metrics,
        progress_line,
        write_eval_scores,
    )

    config, train, test = prepared.config, prepared.train, prepared.test
    test_indices = list(range(len(test))) if test else []
    test_batch = test.batch(test_indices, prepared.pad_id) if test else None
    sink = JsonlSink(prepared.output_dir, METRICS_FILE)
    began, row = time.monotonic(), {}
    try:
        for step in range(prepared.num_steps):
            indices = step_indices(len(train), config.pairs_per_step, step, config.seed)
            started = time.monotonic()
            row = group.train_pairs(train.batch(indices, prepared.pad_id))
            seconds = time.monotonic() - started
            row |= {"perf/step_time_s": seconds,
                    "perf/pairs_per_s": config.pairs_per_step / seconds,
                    "perf/tokens_per_s": train.num_tokens(indices) / seconds,
                    "epoch": (step + 1) * config.pairs_per_step / len(train)}
            last = step == prepared.num_steps - 1
            if test_batch is not None and (last or (config.eval_every
                                                    and (step + 1) % config.eval_every == 0)):
                scores = group.scores(test_batch)
                row |= held_out_metrics(scores, test.kinds, test.margins,
                                        config.center_rewards_coefficient)
                if last:
                    write_eval_scores(prepared.output_dir / EVAL_SCORES_FILE, scores,
                                      test.kinds)
            sink.write(step, row)
            left = (time.monotonic() - began) / (step + 1) * (prepared.num_steps - step - 1)
            log(progress_line(step, prepared.num_steps, row, left))
    finally:
        sink.close()
    if "eval/accuracy" in row:
        log(f"held-out ({len(test_indices)} pairs): {eval_summary(row)}")
    return row


def _save(group: Any, prepared: Prepared, final: Path) -> None:
    """The final Hugging Face folder, written aside and renamed into place."""
    staging = final.with_name(f".{final.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    group.save_reward_model(str(staging))
    prepared.tokenizer.save_pretrained(str(staging))
    info = {"chat_template": prepared.config.chat_template,
            "max_length": prepared.config.max_length, "base_model": prepared.config.model}
    (staging / REWARD_MODEL_INFO).write_text(json.dumps(info, indent=2) + "\n")
    staging.rename(final)
