"""The configuration of ``tally train-rm``: one reward-model training run, validated
before anything starts. Imports only pydantic, PyYAML, the packages' ``config`` modules
and the record keys of rollout/preference_pairs.py (no torch, no Ray); problems name
their field as a job config's do.

The ranks take the policy trainer's own schema (``trainer:``, trainer/config.py) for
their layout, precision, micro-batching and optimizer; what has no meaning for a reward
model (context parallelism, LoRA, Megatron, loss terms, PPO epochs) is refused naming
the field.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from rollout.config_paths import FILE, MODEL, OUTPUT
from rollout.preference_pairs import REQUIRED
from services.config.errors import validation_error
from services.config.job import apply_override, job_mapping, load_yaml, read_config_text
from trainer.config import LossConfig, TrainerConfig


class PreferenceDataConfig(BaseModel):
    """Preference pairs: JSONL records {"prompt", "chosen", "rejected"}
    (rollout/preference_pairs.py); relative paths are from the working directory."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    train: str = Field(min_length=1, json_schema_extra=FILE)
    """The pairs to train on."""
    test: str | None = Field(default=None, min_length=1, json_schema_extra=FILE)
    """Held-out pairs: their accuracy and loss every eval_every steps and at the end
    (null: no evaluation)."""
    margin: StrictBool | str = False
    """Each pair's margin m in −log σ(r⁺ − r⁻ − m) (TRL's RewardTrainer): true reads
    every record's "margin" key, a string names the key; every record must then have a
    finite number there (false: no margin, m = 0)."""

    @field_validator("margin")
    @classmethod
    def _margin_is_a_column(cls, value: bool | str) -> bool | str:
        if isinstance(value, str) and (not value.strip() or value in (*REQUIRED, "kind")):
            raise ValueError(f"{value!r} cannot be the margin column: give true (the "
                             "\"margin\" key) or the name of a key that holds the margin, "
                             f"not empty or one of {', '.join(REQUIRED)}, kind")
        return value

    @property
    def margin_key(self) -> str | None:
        """The key every record's margin is read from (None: no margin)."""
        if isinstance(self.margin, str):
            return self.margin
        return "margin" if self.margin else None


class RewardModelConfig(BaseModel):
    """One reward-model training run (``tally train-rm``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(default="reward-model", min_length=1, max_length=100,
                      pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Run name: letters, digits, '-', '_' and '.' (the default output folder's)."""
    model: str = Field(default="tiny", json_schema_extra=MODEL)
    """The base model, as ``rollout.model``: ``tiny``, ``smollm2-135m-instruct`` or a local
    Hugging Face folder; its decoder gets a fresh one-label score head."""
    chat_template: bool = False
    """Score the tokenizer's chat template over [user: prompt, assistant: response]
    instead of prompt + response (rollout/reward_text.py); the reward actor must use the
    same setting (the output folder's tally_reward_model.json says it)."""
    data: PreferenceDataConfig
    """Train and held-out preference pairs."""
    center_rewards_coefficient: float = Field(default=0.0, ge=0, le=1e6,
                                              allow_inf_nan=False)
    """c: adds c · mean over the step's pairs of (r⁺ + r⁻)² to the loss, pulling each
    pair's mean score to 0 (TRL's center_rewards_coefficient; Eisenstein et al. 2023 use
    0.01); 0: no centring term."""
    max_length: int = Field(default=512, ge=2, le=1_048_576)
    """Tokens of one scored text at most: a longer one is cut on the left, keeping its
    leading special tokens and template prefix and its end (where the score is read), as
    the reward actor's ``truncation: left`` does (rollout/reward_text.py)."""
    num_epochs: float | None = Field(default=None, gt=0, le=10_000)
    """Passes over the train pairs (steps = ⌈epochs · pairs / pairs_per_step⌉); the
    default when num_steps is not set is 1."""
    num_steps: int | None = Field(default=None, ge=1)
    """Optimizer steps to take instead of num_epochs."""
    pairs_per_step: int = Field(default=16, ge=1, le=1_000_000)
    """P: pairs of one optimizer step, over all DP ranks (the loss is their mean)."""
    eval_every: int = Field(default=0, ge=0)
    """Evaluate the held-out pairs every this many steps (0: only at the end)."""
    seed: int = Field(default=0, ge=0)
    """Seed of the score head's initialisation and of the order of pairs in each epoch."""
    output_dir: str | None = Field(default=None, json_schema_extra=OUTPUT)
    """Run folder (metrics.jsonl, eval_scores.jsonl, final_model/); default
    <data dir>/jobs/<name>-<time>. A folder that holds a finished run is refused."""
    trainer: TrainerConfig = TrainerConfig()
    """The ranks: dp_size, packing, dtype, max_tokens_per_micro_batch (≥ 2 · max_length:
    a pair never splits), optimizer, threads, GPUs and timeouts (trainer/config.py);
    cp_size must be 1 and backend fsdp, without lora, loss terms or ppo_epochs."""

    @model_validator(mode="after")
    def _length_of_training(self) -> RewardModelConfig:
        if self.num_epochs is not None and self.num_steps is not None:
            raise ValueError("num_steps: set num_epochs or num_steps, not both")
        return self

    @model_validator(mode="after")
    def _trainer_applies(self) -> RewardModelConfig:
        trainer = self.trainer
        if trainer.cp_size != 1:
            raise ValueError(f"trainer.cp_size: train-rm has no context parallelism (got "
                             f"{trainer.cp_size}); set trainer.cp_size: 1")
        if trainer.backend != "fsdp":
            raise ValueError(f"trainer.backend: train-rm runs on fsdp, not {trainer.backend}")
        if trainer.lora is not None:
            raise ValueError("trainer.lora: train-rm trains every weight; remove trainer.lora")
        if trainer.shared_prefix:
            raise ValueError("trainer.shared_prefix: a pair's two texts are packed whole; "
                             "remove trainer.shared_prefix")
        if trainer.loss != LossConfig():
            raise ValueError("trainer.loss: the loss of train-rm is Bradley-Terry's, its "
                             "only terms data.margin and center_rewards_coefficient; "
                             "remove trainer.loss")
        if trainer.ppo_epochs != 1:
            raise ValueError("trainer.ppo_epochs: train-rm passes over its data num_epochs "
                             "times; remove trainer.ppo_epochs")
        if "seed" in trainer.model_fields_set:
            raise ValueError("trainer.seed: train-rm has one seed, the top-level seed")
        if trainer.max_tokens_per_micro_batch < 2 * self.max_length:
            raise ValueError(f"trainer.max_tokens_per_micro_batch: "
                             f"{trainer.max_tokens_per_micro_batch} cannot hold one pair "
                             f"of max_length {self.max_length} (2 × {self.max_length} "
                             f"tokens)")
        return self

    def total_steps(self, num_train_pairs: int) -> int:
        """Optimizer steps of the run over ``num_train_pairs`` pairs."""
        if self.num_steps is not None:
            return self.num_steps
        epochs = 1.0 if self.num_epochs is None else self.num_epochs
        return max(1, math.ceil(epochs * num_train_pairs / self.pairs_per_step))

    def rank_config(self, num_threads: int) -> TrainerConfig:
        """The ranks' trainer config: the run's seed, no shared prefix, ``num_threads``
        where trainer.num_threads is unset."""
        return self.trainer.model_copy(update={
            "seed": self.seed, "shared_prefix": False,
            "num_threads": self.trainer.num_threads or num_threads})


def parse_reward_model_config(text: str, overrides: list[str] | None = None,
                              source: str = "<config>") -> RewardModelConfig:
    """YAML text plus ``--set key=value`` overrides -> a validated config; ConfigError
    naming each field at fault."""
    data = job_mapping(load_yaml(text, source), source, "config")
    for override in overrides or []:
        apply_override(data, override)
    try:
        return RewardModelConfig.model_validate(data)
    except ValidationError as err:
        raise validation_error(err, source, RewardModelConfig) from None


def load_reward_model_config(path: str | Path, overrides: list[str] | None = None
                             ) -> RewardModelConfig:
    """A config file plus overrides (``services.config.job.load_job_config``'s rules)."""
    return parse_reward_model_config(read_config_text(path), overrides, source=str(path))
