"""The driver's own config sections: evaluation during training (``eval:``, run by
``evaluation.py``) and where metrics go besides the job folder (``logging:``, the
sinks). Imports only pydantic and rollout's config module, so the controller validates a
job without torch or Ray; ``services/config/job.py`` composes them into JobConfig."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from rollout.config import DatasetConfig
from rollout.config_paths import FILE


def _path_or_block(value: Any) -> str:
    return "path" if isinstance(value, str) else "block"


EvalDataset = Annotated[
    Annotated[Annotated[str, Field(min_length=1, max_length=4096)], Tag("path")]
    | Annotated[DatasetConfig, Tag("block")],
    Discriminator(_path_or_block),
]
"""eval.dataset: a file's path (JSONL; Parquet when it ends in .parquet) or a dataset block."""


class EvalConfig(BaseModel):
    """Evaluation during training on held-out prompts, through the rollout engines:
    greedy accuracy and pass@k of the start weights, every ``every_steps`` rollout steps,
    and of the final trained weights, scored by the job's reward function."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    enabled: bool = False
    """Evaluate during training."""
    every_steps: int = Field(default=10, gt=0)
    """Evaluate the weights every this many rollout steps (0, n, 2n, …) and the final ones."""
    dataset: EvalDataset | None = Field(default=None, json_schema_extra=FILE)
    """Held-out prompts: a JSONL path (read with rollout.dataset's prompt_key, label_key and
    metadata_keys) or a dataset block; None: the training dataset's held-out split
    (math_words, reasoning_gym, or a file with a split_fraction)."""
    split_fraction: float | None = Field(default=None, gt=0, lt=1)
    """Hold out this share of a jsonl / parquet rollout.dataset for evaluation, chosen by a
    hash of each record's prompt, so training and evaluation never share a record (sets
    rollout.dataset.split_fraction); None: no share carved."""
    num_prompts: int | None = Field(default=64, gt=0)
    """Evaluate the first this many held-out prompts; None: all of them."""
    num_samples: int = Field(default=4, ge=0, le=64)
    """Samples per prompt for pass@k (0: greedy accuracy only)."""
    k: int | None = Field(default=None, gt=0)
    """The k of pass@k (≤ num_samples); None: num_samples."""
    temperature: float | None = Field(default=None, gt=0)
    """Sampling temperature of the pass@k samples; None: rollout.sampling.temperature."""
    correct_reward: float = 1.0
    """A response counts as correct when its reward is at least this."""

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalConfig:
        if self.k is not None and self.k > self.num_samples:
            raise ValueError(f"k: pass@{self.k} needs at least {self.k} samples per prompt, "
                             f"num_samples is {self.num_samples}")
        return self

    @model_validator(mode="after")
    def _one_source_of_heldout_prompts(self) -> EvalConfig:
        if self.split_fraction is not None and self.dataset is not None:
            raise ValueError("split_fraction: carves the held-out prompts out of "
                             "rollout.dataset, but eval.dataset names them already; set one "
                             "of the two")
        return self

    @property
    def pass_k(self) -> int:
        return self.k if self.k is not None else self.num_samples


class WandbConfig(BaseModel):
    """A Weights & Biases run that receives the same metrics as metrics.jsonl.

    Needs the ``wandb`` extra (``pip install 'tally[wandb]'``); the run's files go under
    <job>/wandb and its config is the resolved job config.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    project: str = Field(min_length=1, max_length=128)
    """W&B project the run belongs to."""
    name: str | None = Field(default=None, min_length=1, max_length=128)
    """Display name of the run; None: the job's name."""
    entity: str | None = Field(default=None, min_length=1)
    """W&B user or team; None: the logged-in user's default entity."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online: stream to the server; offline: write only under <job>/wandb (upload later
    with ``wandb sync``); disabled: log nothing."""
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=64)
    """Tags of the run (at most 64, each 1–64 characters)."""


class LoggingConfig(BaseModel):
    """Where metrics go besides metrics.jsonl and TensorBoard."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    wandb: WandbConfig | None = None
    """A Weights & Biases run per job; None: no W&B."""
    samples_per_step: int = Field(default=8, ge=0, le=4096)
    """Samples of each rollout step written to samples.jsonl as text (prompt, response,
    label, rewards, advantage): whole groups drawn at random (seeded by the job's seed and
    the step), not the first ones; every evaluation sample is written too."""
    sample_tokens: bool = True
    """Write each training sample's response token by token (``tokens``: advantage, the
    engine's and the trainer's log-prob, entropy), the job page's per-token view; costs
    one forward pass of the logged samples per step."""
    samples_max_mb: float = Field(default=64.0, gt=0, le=65536)
    """samples.jsonl's bound (MiB): past it the oldest steps are thinned (every other one
    of the older half dropped, evaluations kept last) until it fits."""
