"""JobConfig: one job's whole configuration, validated once at submit/start.

Composes the rollout, trainer and aggregation schemas (each defined next to the code it
configures) and checks the rules that span them. Imports only pydantic, PyYAML and the
packages' ``config`` modules, so the controller validates a job without torch or Ray.
"""

from __future__ import annotations

import functools
import json
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from rollout.config import (
    DatasetConfig,
    FileDatasetConfig,
    RolloutConfig,
    SyntheticDatasetConfig,
)
from rollout.config_paths import OUTPUT
from services.config.errors import ConfigError, ConfigProblem, validation_error
from services.config.errors import error_field as error_field  # where the controller finds it
from services.driver.config import EvalConfig, LoggingConfig
from trainer.config import (
    GSPO_EPS_CLIP,
    LORA_ALL_LINEAR,
    AggregationConfig,
    CriticConfig,
    LossConfig,
    ObjectiveConfig,
    TrainerConfig,
)

FILE_DATASETS = ("jsonl", "parquet")
"""rollout.dataset types read from a file, which eval.split_fraction can split."""
EMPTY_CONFIG = "is empty; a job config is a YAML mapping, e.g. configs/demo.yaml"
"""Said of a config file (or text) with nothing but whitespace, comments or ``null``."""

SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML has it (far faster on hostile input), else Python's."""


class WarmupConfig(BaseModel):
    """A short supervised pass on the synthetic task before RL (a warm start)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    enabled: bool = False
    """Run the warm-up (cached in the data folder, so only the first job pays)."""
    num_steps: int = Field(default=300, gt=0)
    """Supervised optimizer steps."""
    batch_size: int = Field(default=32, gt=0)
    """Examples per supervised step."""
    lr: float = Field(default=3e-3, gt=0)
    """AdamW learning rate of the warm-up."""
    seed: int = 0
    """Seed of the warm-up's examples (distinct from the RL prompts' seed)."""


ASYNC_TIS_CAP = 2.0
"""trainer.loss.tis_cap of an async job that sets none (slime's and verl's usual cap)."""


class JobConfig(BaseModel):
    """One RL post-training job."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(default="tally-job", min_length=1, max_length=100,
                      pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Job name: letters, digits, '-', '_' and '.'."""
    num_steps: int = Field(default=20, gt=0)
    """Rollouts to run; each takes rollout.num_steps_per_rollout × trainer.ppo_epochs
    optimizer steps (the LR schedule counts optimizer steps)."""
    aggregation: AggregationConfig = AggregationConfig()
    """How the pg loss of a step is aggregated (docs/loss-aggregation.md)."""
    rollout: RolloutConfig = RolloutConfig()
    """Prompts, engines, sampling, rewards and advantages."""
    trainer: TrainerConfig = TrainerConfig()
    """Backend, parallel layout, losses and optimizer."""
    critic: CriticConfig = CriticConfig()
    """PPO's learned value model (rollout.advantage.type: gae): its own trainer group."""
    warmup: WarmupConfig = WarmupConfig()
    """Optional supervised warm start on the synthetic task."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation during training (accuracy, pass@k)."""
    logging: LoggingConfig = LoggingConfig()
    """Extra metrics sinks (Weights & Biases)."""
    output_dir: str | None = Field(default=None, json_schema_extra=OUTPUT)
    """Job folder for metrics, logs and checkpoints; default <data dir>/jobs/<name>-<time>."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every this many steps (0: only at the end)."""
    checkpoint_keep_last: int = Field(default=3, ge=0)
    """Keep the newest this many checkpoints, plus the final and the best-evaluated one
    (eval/accuracy); older ones are deleted after each commit (0: keep every one)."""
    resume: bool = True
    """Continue from the newest checkpoint in output_dir when there is one (`tally train
    --resume auto|PATH` / `--no-resume` choose per run; a changed setting that breaks
    exactness is refused unless --force)."""
    max_restarts: int = Field(default=1, ge=0)
    """Restart a dead actor group from the last checkpoint at most this many times."""
    placement_timeout_s: float = Field(default=1800.0, gt=0)
    """How long a job that fits the Ray cluster, but not what is free now, waits for its
    resources (its ``waiting`` event says what is short) before it fails. A job larger
    than the whole cluster fails at once, naming the fields to lower."""
    colocate: bool = False
    """Run the rollout engines inside the trainer ranks' bundles (same node and device)
    instead of bundles of their own; torch engines with the FSDP trainer run inside the
    ranks' processes, generating from the ranks' own weights
    (trainer.weight_sync.transport: in_process)."""
    num_ranks: int | None = Field(default=None, gt=0)
    """Trainer actors to start; when given it must equal dp_size × cp_size × tp_size."""
    _implied: tuple[ConfigProblem, ...] = PrivateAttr(default=())
    """Settings a rule filled in (said by :meth:`warnings`)."""

    @model_validator(mode="before")
    @classmethod
    def _aggregation_set_once(cls, data: object) -> object:
        """The pg aggregation has one home: the top-level `aggregation:`."""
        trainer = data.get("trainer") if isinstance(data, dict) else None
        loss = trainer.get("loss") if isinstance(trainer, dict) else None
        if isinstance(loss, dict) and "aggregation" in loss:
            raise ValueError("trainer.loss.aggregation: set the pg aggregation at the top-level "
                             "'aggregation:' of the job")
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _async_corrects_staleness(cls, data: object, handler: Any) -> JobConfig:
        """With rollout.async_steps ≥ 1 samples come from weights up to k versions old:
        TIS through the rollout log-probs is on (trainer.loss.tis_cap 2.0, i.e.
        rollout_correction {level: token, mode: truncate, high: 2}, unless the user set
        tis_cap or rollout_correction, or old_log_probs: proximal, which brings its own
        behaviour weight: the same token truncation at rollout_correction's default cap).
        Said where it is set: the resolved config holds it (proximal resolved to trainer
        with its correction) and :meth:`warnings` names it (the driver logs it and writes
        it as an event at start)."""
        from trainer.config import PROXIMAL  # kept inside the one validator that reads it

        rollout = data.get("rollout") if isinstance(data, dict) else None
        trainer = (data.get("trainer") or {}) if isinstance(data, dict) else None
        loss = (trainer.get("loss") or {}) if isinstance(trainer, dict) else None
        proximal = isinstance(loss, dict) and loss.get("old_log_probs") == PROXIMAL
        implied = (isinstance(rollout, dict) and bool(rollout.get("async_steps"))
                   and isinstance(loss, dict) and "tis_cap" not in loss
                   and "rollout_correction" not in loss and not proximal)
        if implied:
            data = {**data, "trainer": {**trainer, "loss": {**loss, "tis_cap": ASYNC_TIS_CAP}}}
        config = handler(data)
        if implied:
            config._implied = (ConfigProblem(
                "trainer.loss.tis_cap", f"set to {ASYNC_TIS_CAP:g} because rollout.async_steps "
                f"is {config.rollout.async_steps} (TIS corrects the samples' staleness); set "
                "it yourself, or to null for none, to choose"),)
        if proximal:
            weight = config.trainer.loss.correction
            assert weight is not None  # LossConfig resolves proximal with one
            config._implied = (ConfigProblem("trainer.loss.old_log_probs", (
                "proximal (decoupled PPO) is resolved to old_log_probs: trainer (π_prox, the "
                "trainer's log-probs at the step's start) with the off-policy correction {level: "
                f"{weight.level}, mode: {weight.mode}, high: {weight.high:g}}} weighting "
                "each token by its own π_prox/π_behav")),)
        return config

    def with_notes(self, notes: list[ConfigProblem]) -> JobConfig:
        """This config, with ``notes`` (what ``--set`` changed besides the field it set)
        said by :meth:`warnings`."""
        if notes:
            self._implied = (*self._implied, *notes)
        return self

    @model_validator(mode="after")
    def _trainable_temperature(self) -> JobConfig:
        if self.rollout.sampling.temperature == 0:
            raise ValueError("rollout.sampling.temperature: 0 (greedy) cannot be trained on: "
                             "the policy gradient needs the log-probs of a sampling "
                             "distribution softmax(logits / T); use T > 0 (e.g. 1.0)")
        return self

    @model_validator(mode="after")
    def _weight_transport_fits_engine(self) -> JobConfig:
        transport, engine = self.trainer.weight_sync.transport, self.rollout.engine.type
        serves = {"torch": ("auto", "in_process", "object_store"),
                  "sglang": ("auto", "disk", "nccl", "cuda_ipc")}[engine]
        if transport not in serves:
            raise ValueError(f"trainer.weight_sync.transport: {transport} cannot reach "
                             f"{engine} engines; use one of {', '.join(serves)}")
        if transport in ("nccl", "cuda_ipc") and not self.trainer.num_gpus_per_rank:
            raise ValueError(f"trainer.weight_sync.transport: {transport} sends from GPU "
                             "trainer ranks; set trainer.num_gpus_per_rank, or use disk")
        if transport == "in_process" and not self.colocate:
            raise ValueError("trainer.weight_sync.transport: in_process runs the engines "
                             "inside the trainer ranks; set colocate: true, or use "
                             "object_store")
        if transport == "in_process" and self.trainer.backend != "fsdp":
            raise ValueError("trainer.weight_sync.transport: in_process needs "
                             "trainer.backend: fsdp (Megatron's engines run as actors: use "
                             "object_store)")
        engines = self.rollout.engine.num_engines
        if self.weight_transport() == "in_process" and engines > self.trainer.world_size:
            raise ValueError(f"rollout.engine.num_engines: {engines} engines inside the "
                             f"trainer ranks need as many ranks; the trainer has "
                             f"{self.trainer.world_size} (colocate: true with a torch "
                             "engine generates in the ranks' processes; set "
                             "trainer.weight_sync.transport: object_store for engine actors)")
        if transport == "cuda_ipc" and not self.colocate:
            raise ValueError("trainer.weight_sync.transport: cuda_ipc needs the engine on "
                             "trainer rank 0's GPU; set colocate: true, or use nccl")
        return self

    @model_validator(mode="after")
    def _sglang_serves_adapters(self) -> JobConfig:
        """Under trainer.lora an SGLang server is launched with LoRA serving for the
        trainer's rank and target modules; an engine block naming its own must cover
        them."""
        lora, engine = self.trainer.lora, self.rollout.engine
        if lora is None or engine.type != "sglang":
            return self
        targets = ["all"] if lora.target_modules == LORA_ALL_LINEAR else lora.target_modules
        if engine.max_lora_rank is not None and engine.max_lora_rank < lora.rank:
            raise ValueError(f"rollout.engine.max_lora_rank: {engine.max_lora_rank} is below "
                             f"trainer.lora.rank {lora.rank}; the server could not load the "
                             "adapters (leave it unset to follow trainer.lora)")
        served = engine.lora_target_modules
        if served is not None and "all" not in served and not set(targets) <= set(served):
            raise ValueError(f"rollout.engine.lora_target_modules: {served} does not cover "
                             f"trainer.lora.target_modules {lora.target_modules} (leave it "
                             "unset to follow trainer.lora)")
        serving = {"max_lora_rank": engine.max_lora_rank or lora.rank,
                   "lora_target_modules": served or targets}
        rollout = self.rollout.model_copy(update={"engine": engine.model_copy(update=serving)})
        object.__setattr__(self, "rollout", rollout)  # frozen: filled once, here
        return self

    def weight_transport(self) -> str:
        """The transport ``auto`` resolves to for this job's engines and trainer."""
        transport = self.trainer.weight_sync.transport
        if transport != "auto":
            return transport
        if self.trainer.lora is not None:  # adapters only: engine actors, or files to load
            return "object_store" if self.rollout.engine.type == "torch" else "disk"
        if self.rollout.engine.type == "torch":
            colocated = self.colocate and self.trainer.backend == "fsdp"
            return "in_process" if colocated else "object_store"
        if not self.trainer.num_gpus_per_rank:
            return "disk"
        # NCCL refuses two ranks of one group on one GPU: a colocated server maps IPC
        # handles of the trainer's own buffers instead
        return "cuda_ipc" if self.colocate else "nccl"

    def engine_dtype(self) -> str:
        """The dtype the engines hold their weights in (what a sync sends)."""
        engine = self.rollout.engine
        if engine.type == "torch":
            return engine.dtype
        flags = list(engine.extra_args)
        given = flags[flags.index("--dtype") + 1] if "--dtype" in flags[:-1] else "bfloat16"
        return {"half": "float16", "float": "float32", "auto": "bfloat16"}.get(given, given)

    @model_validator(mode="after")
    def _critic_serves_gae(self) -> JobConfig:
        gae = self.rollout.advantage.type == "gae"
        if gae and not self.critic.enabled:
            raise ValueError("rollout.advantage.type: gae needs the critic's values; set "
                             "critic.enabled: true (or use grpo, which needs no critic)")
        # a custom estimator may need the critic: its class says so, checked in the job's
        # preflight (the controller never imports it)
        custom = self.rollout.advantage.type == "custom"
        if self.critic.enabled and not (gae or custom):
            raise ValueError(f"critic.enabled: the critic's values are used by "
                             f"rollout.advantage.type: gae, not "
                             f"{self.rollout.advantage.type}; set type: gae or disable it")
        if self.critic.enabled and self.trainer.backend != "fsdp":
            raise ValueError(f"critic.enabled: the critic trains on trainer.backend: fsdp "
                             f"only (the {self.trainer.backend} backend has no value model);"
                             " use backend: fsdp for PPO with a critic")
        return self

    def critic_trainer_config(self) -> TrainerConfig:
        """The critic group's trainer config (``CriticConfig.trainer_config``)."""
        return self.critic.trainer_config(self.trainer)

    def critic_objective_config(self) -> ObjectiveConfig:
        """The critic's objective: its aggregation in the main term, resolved like the
        policy's (the step plan weighs the value term by it: trainer/terms.py ``VALUE``).
        The policy's ``aggregation.custom_reducer`` weighs the pg term only: the critic
        takes the job's mode (or ``critic.aggregation``), never the reducer."""
        job = self.aggregation.model_copy(update={"custom_reducer": None})
        return ObjectiveConfig.compose(self.critic.aggregation_config(job),
                                       LossConfig(), self.max_response_len,
                                       self.rollout.sampling.temperature)

    @model_validator(mode="after")
    def _ranks_match_layout(self) -> JobConfig:
        if self.num_ranks is not None and self.num_ranks != self.trainer.world_size:
            raise ValueError(
                f"num_ranks: {self.num_ranks} trainer actors asked for, but trainer.dp_size × "
                f"cp_size × tp_size = {self.trainer.world_size}")
        return self

    @model_validator(mode="after")
    def _warmup_needs_synthetic_task(self) -> JobConfig:
        if self.warmup.enabled and not isinstance(self.rollout.dataset, SyntheticDatasetConfig):
            raise ValueError("warmup.enabled: the warm-up trains on the synthetic task; "
                             "use rollout.dataset.type: synthetic or disable it")
        return self

    @model_validator(mode="before")
    @classmethod
    def _eval_split_carves_training_file(cls, data: object) -> object:
        """eval.split_fraction f holds out a share f of a jsonl / parquet rollout.dataset,
        by a hash of each record's prompt: the training side of the same split is what the
        job trains on, so the resolved config holds rollout.dataset.split_fraction: f (a
        fraction set there already is left to :meth:`_eval_split_agrees` to compare)."""
        evaluation = data.get("eval") if isinstance(data, dict) else None
        fraction = evaluation.get("split_fraction") if isinstance(evaluation, dict) else None
        rollout = data.get("rollout") if isinstance(data, dict) else None
        dataset = rollout.get("dataset") if isinstance(rollout, dict) else None
        valid = (isinstance(fraction, int | float) and not isinstance(fraction, bool)
                 and 0 < fraction < 1)  # else EvalConfig names what is wrong with it
        if (not valid or not isinstance(dataset, dict) or "split_fraction" in dataset
                or dataset.get("type") not in FILE_DATASETS):
            return data
        return {**data, "rollout": {**rollout, "dataset": {**dataset,
                                                           "split_fraction": fraction}}}

    @model_validator(mode="after")
    def _eval_split_agrees(self) -> JobConfig:
        fraction, dataset = self.eval.split_fraction, self.rollout.dataset
        if fraction is None:
            return self
        if not isinstance(dataset, FileDatasetConfig):
            own = (" (it has a held-out split of its own, which eval uses when eval.dataset "
                   "is unset: drop split_fraction)" if hasattr(dataset, "split") else
                   "; name the held-out prompts in eval.dataset instead")
            raise ValueError(f"eval.split_fraction: splits a jsonl or parquet rollout.dataset, "
                             f"not {dataset.type}{own}")
        if dataset.split_fraction != fraction:
            raise ValueError(f"eval.split_fraction: {fraction:g} differs from "
                             f"rollout.dataset.split_fraction {dataset.split_fraction:g}; "
                             "set one of the two")
        return self

    @model_validator(mode="after")
    def _eval_has_prompts(self) -> JobConfig:
        dataset = self.rollout.dataset
        held_out = self.eval_dataset() if self.eval.dataset is not None else None
        if (isinstance(held_out, FileDatasetConfig) and isinstance(dataset, FileDatasetConfig)
                and Path(held_out.path) == Path(dataset.path)
                and held_out.split_fraction is None):
            raise ValueError("eval.dataset: is the training file, so every evaluated record "
                             "is trained on; name a held-out file, or leave eval.dataset "
                             "unset and set eval.split_fraction (e.g. 0.1)")
        if not self.eval.enabled or self.eval.dataset is not None:
            return self
        if not has_heldout_split(dataset):
            carve = (", or set eval.split_fraction (e.g. 0.1) to hold out that share of the "
                     "training file" if isinstance(dataset, FileDatasetConfig) else "")
            raise ValueError(f"eval.dataset: rollout.dataset (type {dataset.type}) has no "
                             "held-out split; name the held-out prompts here (a JSONL path, "
                             f"e.g. eval.dataset: data/heldout.jsonl, or a dataset block){carve}")
        if dataset.split == "heldout":
            raise ValueError("eval.dataset: rollout.dataset.split is heldout, so its held-out "
                             "split is what the job trains on; train on split: train, or name "
                             "the held-out prompts here")
        return self

    def eval_dataset(self) -> DatasetConfig:
        """The held-out prompts of the evaluation: eval.dataset (a path read as a file
        dataset with rollout.dataset's keys), or the training dataset's held-out split."""
        dataset = self.eval.dataset
        if isinstance(dataset, str):
            return file_dataset_like(dataset, self.rollout.dataset)
        if dataset is not None:
            return dataset
        return self.rollout.dataset.model_copy(update={"split": "heldout"})

    @property
    def num_updates_per_rollout(self) -> int:
        """Optimizer steps per rollout: mini-batches of whole groups × PPO epochs."""
        return self.rollout.num_steps_per_rollout * self.trainer.ppo_epochs

    @property
    def num_optimizer_steps(self) -> int:
        """Optimizer steps of the whole job: what a critic's LR schedule spans."""
        return self.num_steps * self.num_updates_per_rollout

    @property
    def policy_schedule_steps(self) -> int:
        """What the policy's LR schedule spans: its own optimizer steps, the rollouts of the
        critic's warm-up (``critic.warmup_steps``, which train the critic only) left out."""
        from trainer.optim import schedule_steps

        warmup = self.critic.warmup_steps if self.critic.enabled else 0
        return schedule_steps(self.num_steps, self.num_updates_per_rollout, warmup)

    def warnings(self) -> list[ConfigProblem]:
        """Settings a rule chose for the user, and options that would be inert: valid, but
        probably not what the user meant."""
        loss = self.trainer.loss
        said = list(self._implied)
        if (self.rollout.async_steps and loss.old_log_probs == "rollout"
                and loss.correction is not None and loss.policy_loss != "importance_sampling"):
            field = "tis_cap" if loss.tis_cap is not None else "rollout_correction"
            said.append(ConfigProblem(f"trainer.loss.{field}", (
                "has no effect with trainer.loss.old_log_probs: rollout (π_old is the "
                "engine's, so the TIS weight π_old/π_rollout is 1); staleness is then "
                "corrected by the PPO ratio π/π_rollout, clipped by eps_clip")))
        if self.rollout.environment is not None and "reward" in self.rollout.model_fields_set:
            said.append(ConfigProblem("rollout.reward", (
                "has no effect with rollout.environment: an episode's reward is the sum of "
                "what the environment's steps returned")))
        engine, ranks = self.rollout.engine, self.trainer.world_size
        if self.weight_transport() == "in_process":
            said += [ConfigProblem(f"rollout.engine.{name}", "has no effect on the colocated "
                                   "fast path: the engines run in the trainer ranks, on "
                                   "their device and threads")
                     for name in ("device", "num_threads") if name in engine.model_fields_set]
            if self.rollout.async_steps and engine.num_engines < ranks:
                said.append(ConfigProblem("rollout.engine.num_engines", (
                    f"{engine.num_engines} engines in {ranks} trainer ranks with "
                    "rollout.async_steps > 0: a rank without an engine waits inside the next "
                    "collective while the others generate (trainer.collective_timeout_s "
                    f"bounds the wait); set it to {ranks} to share the generation")))
        if self.num_updates_per_rollout > 1 or loss.old_log_probs == "rollout":
            return said
        why = ("has no effect: with one update per rollout and old_log_probs: trainer the "
               f"{loss.policy_loss} ratio is exactly 1 (set rollout.rollout_batch_size or "
               "trainer.ppo_epochs for several updates)")
        gspo_default = loss.policy_loss == "gspo" and loss.eps_clip_high == GSPO_EPS_CLIP[1]
        return said + [ConfigProblem(f"trainer.loss.{name}", why)
                       for name in ("eps_clip_high", "dual_clip_c")
                       if getattr(loss, name) is not None
                       and not (name == "eps_clip_high" and gspo_default)]

    @property
    def max_response_len(self) -> int:
        """The most tokens of a response (resolves divisor: max_response_len): the
        generation budget, or an episode's environment.max_total_tokens (unset: the
        model's context, rollout/token_budget.response_budget)."""
        from rollout.token_budget import model_context, response_budget

        return response_budget(self.rollout, model_context(self.rollout.model))

    def objective_config(self) -> ObjectiveConfig:
        """The trainer's objective: every aggregation with `max_response_len` resolved to
        the rollout's budget (once, here) and the sampling temperature."""
        return ObjectiveConfig.compose(self.aggregation, self.trainer.loss,
                                       self.max_response_len, self.rollout.sampling.temperature)


def has_heldout_split(dataset: DatasetConfig) -> bool:
    """Does the dataset hold records out by content (a ``split``; a file only with a
    ``split_fraction``)?"""
    if isinstance(dataset, FileDatasetConfig):
        return dataset.split_fraction is not None
    return hasattr(dataset, "split")


def file_dataset_like(path: str, training: DatasetConfig) -> FileDatasetConfig:
    """The file at ``path`` (parquet for ``.parquet``, else JSONL) read with the keys of the
    training dataset (prompt_key, label_key, metadata_keys) when that is a file too, else
    with the defaults: one reward scores both."""
    keys = ({k: getattr(training, k) for k in ("prompt_key", "label_key", "metadata_keys")
             if k in training.model_fields_set}  # an unset label_key keeps its fallback
            if isinstance(training, FileDatasetConfig) else {})
    kind = "parquet" if path.lower().endswith(".parquet") else "jsonl"
    return FileDatasetConfig(type=kind, path=path, **keys)


def _validation_error(err: ValidationError, source: str) -> ConfigError:
    """One problem per pydantic error, on the field a user writes (services/config_errors)."""
    return validation_error(err, source, JobConfig)


def apply_override(data: dict[str, Any], override: str,
                   model: type[BaseModel] | None = None) -> list[ConfigProblem]:
    """Apply ``a.b.c=value`` (value parsed as YAML) to a nested dict in place. Setting a
    variant's ``type`` (``rollout.engine.type=sglang``) drops the fields the old variant
    had and the new one has not; returns one note per dropped field (``model``: the
    schema the data is of, default JobConfig)."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r}",
                          [ConfigProblem(key.strip(), "expected key.path=value")])
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key}", [ConfigProblem(
            key.strip(), f"value is not valid YAML: {err}")]) from err
    key = key.strip()
    set_dotted(data, key, value, source=f"--set {key}")
    if key.rpartition(".")[2] != "type":
        return []
    return drop_other_variant_fields(data, key, value, model or JobConfig)


def _member_models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation admits (through Annotated, unions, Optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _member_models(arg)]


def drop_other_variant_fields(data: dict[str, Any], key: str, value: Any,
                              model: type[BaseModel]) -> list[ConfigProblem]:
    """After ``key`` (``a.b.type``) was set to ``value``: remove from section ``a.b`` the
    keys the variant of that type does not have (they belonged to the old one), one
    note each. Nothing is dropped when no variant has that type (validation says so)."""
    *parents, _ = key.split(".")
    models: list[type[BaseModel]] = [model]
    for part in parents:
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        models = [m for f in fields for m in _member_models(f.annotation)]
    variant = next((m for m in models if "type" in m.model_fields and value in
                    typing.get_args(m.model_fields["type"].annotation)), None)
    section = functools.reduce(lambda node, part: node[part], parents, data)
    if variant is None or not isinstance(section, dict):
        return []
    known = set(variant.model_fields) | {f.alias for f in variant.model_fields.values()
                                         if f.alias}
    notes = []
    for name in [name for name in section if name not in known]:
        del section[name]
        notes.append(ConfigProblem(f"{'.'.join(parents)}.{name}", (
            f"dropped: a field of the previous {'.'.join(parents)} type, which "
            f"type {value!r} (set by --set {key}) does not have")))
    return notes


def set_dotted(data: dict[str, Any], key: str, value: Any, source: str = "") -> None:
    """``data[a][b][c] = value`` for ``key`` ``a.b.c``, creating the sections on the way;
    ConfigError (from ``source``) when one of them is not a section."""
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(source, [ConfigProblem(key, f"{part!r} is not a section")])
        node = child
    node[leaf] = value


def load_yaml(text: str, source: str = "<config>", aliases: bool = True) -> Any:
    """YAML (or JSON) text -> data through the safe loader ("" -> {}); ConfigError with
    the line and column of a syntax error. ``aliases=False`` refuses anchors and aliases
    (a few lines of them can expand to gigabytes) before anything is built."""
    try:
        if not aliases and any(isinstance(event, yaml.AliasEvent)
                               or getattr(event, "anchor", None)
                               for event in yaml.parse(text, Loader=SAFE_LOADER)):
            raise ConfigError(source, [ConfigProblem(
                "", "YAML anchors and aliases are not accepted")])
        return yaml.load(text, Loader=SAFE_LOADER) if text.strip() else {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1} " if mark else ""
        message = f"{where}not valid YAML: {getattr(err, 'problem', None) or err}"
        raise ConfigError(source, [ConfigProblem("", message)]) from err


def job_mapping(data: Any, source: str, what: str = "config") -> dict[str, Any]:
    """Loaded YAML as the mapping a job config is; ConfigError for nothing at all (None:
    an empty ``what``, comments only, ``null``) and for any other kind of value."""
    if data is None:
        raise ConfigError(source, [ConfigProblem("", f"the {what} {EMPTY_CONFIG}")])
    if not isinstance(data, dict):
        raise ConfigError(source, [ConfigProblem(
            "", f"a job config is a mapping of keys, got {type(data).__name__}")])
    return data


def parse_job_config(text: str, overrides: list[str] | None = None,
                     source: str = "<config>", what: str = "config") -> JobConfig:
    """YAML (or JSON) text plus ``--set`` overrides -> a validated JobConfig. "" is no
    text (the defaults and the overrides, as tests build configs); text that says nothing
    (comments only, ``null``) is refused as an empty ``what``."""
    data = job_mapping(load_yaml(text, source), source, what)
    notes = [note for override in overrides or [] for note in apply_override(data, override)]
    try:
        config = JobConfig.model_validate(data)
    except ValidationError as err:
        raise _validation_error(err, source) from None
    return config.with_notes(notes)


def read_config_text(path: str | Path) -> str:
    """A config file's text; a missing file, one not UTF-8, or an empty one (comments
    only, ``null``) is refused rather than run as the defaults (``{}`` is valid)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), [ConfigProblem("", "no such config file")])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(str(path), [ConfigProblem("", "not UTF-8 text")]) from None
    if not text.strip():
        job_mapping(None, str(path), "file")
    return text


def load_job_config(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """A config file (:func:`read_config_text`) plus ``--set`` overrides."""
    return parse_job_config(read_config_text(path), overrides, source=str(path), what="file")


def job_json_schema() -> str:
    """The JSON schema of job configs, for editors (configs/tally.schema.json)."""
    return json.dumps(JobConfig.model_json_schema(), indent=2, sort_keys=True) + "\n"
