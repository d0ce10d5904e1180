"""Configuration schemas of rewards: rules, reward models and judges, one or a weighted
list of them (``rollout.reward``). Imports only pydantic and the stdlib.

    rollout.reward: {type: boxed}                       one part, weight 1
    rollout.reward: [{type: boxed, weight: 1.0},        r = Σ_k weight_k · r_k
                     {type: model, name: rm, path: …, weight: 0.5},
                     {type: custom, class_path: "mymod:MyReward", kwargs: {…}}]

Each part has a ``name`` (its ``type`` when unset; names are unique) under which its
mean and std are logged (``reward/<name>/mean``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from rollout.config_paths import FILE, FOLDER, MODEL

_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_FROZEN = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

BUILT_IN_PARSE = "0-10"
"""The judge's built-in parse: the first whole number 0…10 of its answer, divided by 10."""
YES_NO_PARSE = "yes-no"
"""The judge's other built-in parse: an answer whose first word is yes scores 1, no 0."""


def _check_key_source(api_key_env: str | None, api_key_file: str | None) -> None:
    """A remote part's key: one source at most, an environment variable by its name."""
    if api_key_env is not None and api_key_file is not None:
        raise ValueError("api_key_file: give api_key_env or api_key_file, not both")
    if api_key_env is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", api_key_env):
        raise ValueError(f"api_key_env: {api_key_env!r} is not an environment variable's "
                         "name (the key itself never goes in a config)")


class _Part(BaseModel):
    """What every reward part has: a name and a weight."""

    model_config = _FROZEN

    name: str | None = None
    """Name of this part in metrics (``reward/<name>/mean``) and samples.jsonl; None:
    its type."""
    weight: float = Field(default=1.0, allow_inf_nan=False)
    """The part's weight in the reward, Σ weight · r."""

    @model_validator(mode="after")
    def _name_form(self) -> _Part:
        if self.name is not None and not _NAME.match(self.name):
            raise ValueError(f"name: {self.name!r} is not a metric name (letters, digits, "
                             "_ . -, at most 64)")
        return self

    @property
    def part_name(self) -> str:
        return self.name or str(self.type)


class RewardConfig(_Part):
    """A rule: how a response is scored against its prompt's label."""

    type: Literal["exact_match", "numeric", "boxed", "custom"] = "exact_match"
    """exact_match, numeric (last number), boxed (last \\boxed{}) or custom."""
    custom_function: str | None = None
    """`module:function` for type=custom: (responses, labels, metadata) -> rewards."""
    numeric_tolerance: float = Field(default=1e-6, ge=0.0)
    """Relative tolerance of numeric comparisons (numeric and boxed)."""
    default_on_error: float = Field(default=0.0, allow_inf_nan=False)
    """Reward of a sample whose reward function raised."""
    max_error_rate: float = Field(default=0.1, ge=0.0, le=1.0)
    """Largest fraction of a step's samples whose reward may fail before the step fails."""

    @model_validator(mode="after")
    def _custom_function_iff_custom(self) -> RewardConfig:
        if self.type == "custom":
            if self.custom_function is None:
                raise ValueError("custom_function: type=custom needs 'module:function' "
                                 "(or class_path: 'module:Class', a CustomReward)")
            if not _FUNCTION_PATH.match(self.custom_function):
                raise ValueError(
                    f"custom_function: expected 'module:function', got {self.custom_function!r}"
                )
        elif self.custom_function is not None:
            raise ValueError(
                f"custom_function: only type=custom takes a function, but type={self.type}"
            )
        return self


class CustomPartConfig(_Part):
    """A user's own reward part: a CustomReward subclass (docs/extending.md).

    Named by ``class_path``, built in the job with ``kwargs`` (rollout/reward_parts/
    custom.py). ``type: custom`` with ``custom_function`` is a function rule instead."""

    type: Literal["custom"] = "custom"
    """A custom part (with ``class_path``)."""
    class_path: str
    """``module:Class`` of a CustomReward subclass; located at submit, imported only in
    the job."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class's constructor (JSON values)."""

    @model_validator(mode="after")
    def _class_path_form(self) -> CustomPartConfig:
        if not _FUNCTION_PATH.match(self.class_path):
            raise ValueError(f"class_path: expected 'module:Class', got {self.class_path!r}")
        return self


class RewardModelConfig(_Part):
    """A learned reward model (rollout/reward_model.py): a Hugging Face
    ``AutoModelForSequenceClassification`` folder with one label, served by reward actors
    in the job's gang. The score of a sample is the logit at the last of its ids in the
    RM's own tokenizer (rollout/reward_text.py: the one tokenization train-rm shares)."""

    type: Literal["model"] = "model"
    """A reward model."""
    path: str = Field(json_schema_extra=FOLDER)
    """Local folder of the reward model (``tally train-rm`` writes one)."""
    tokenizer: str | None = Field(default=None, json_schema_extra=FOLDER)
    """Local tokenizer folder; None: the reward model's own."""
    chat_template: bool | None = None
    """Score ``apply_chat_template([user: prompt, assistant: response], tokenize=True)``
    in the RM's tokenizer; False: the record's prompt followed by the response, special
    tokens added once. None: the folder's tally_reward_model.json (train-rm writes it),
    else False; a value that contradicts that file is refused."""
    num_actors: int = Field(default=1, ge=1)
    """Reward actors; a rollout's samples are split between them."""
    num_cpus: float = Field(default=1.0, ge=0.0)
    """CPUs of each reward actor (its bundle in the job's placement group)."""
    num_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs of each reward actor."""
    max_tokens_per_batch: int = Field(default=8192, gt=0)
    """Most tokens of one forward pass, rows × its longest row (padding counted): texts
    are sorted by length and batched under it; a batch that runs out of memory is halved
    and tried again (``reward/<name>/oom_retries``). A text longer alone is a batch of
    its own."""
    batch_size: int | None = Field(default=None, ge=1)
    """Most texts of one forward pass, on top of max_tokens_per_batch; None: only the
    token budget bounds a batch."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype; auto: float32 on CPU, bfloat16 on a GPU."""
    max_length: int | None = Field(default=None, gt=0)
    """Longest text in the RM's tokens (longer ones: ``truncation``). None: the folder's
    tally_reward_model.json, else the RM's context; a value that contradicts that file
    is refused."""
    truncation: Literal["left", "right", "refuse"] = "left"
    """A text over max_length: left keeps its leading special tokens and template prefix
    (BOS, system prompt) and its end, where the score is read (as train-rm does); right
    keeps its first max_length tokens; refuse leaves the sample unscored. Counted in
    ``reward/<name>/truncated``."""
    normalize: bool = False
    """Score (r − μ) / σ with the running mean and std of every raw score so far, this
    rollout's included (saved in checkpoints: a resume continues them)."""


def _check_score_regex(regex: str, field: str) -> None:
    """ValueError naming ``field`` unless ``regex`` compiles with a group (the score)."""
    try:
        groups = re.compile(regex).groups
    except re.error as err:
        raise ValueError(f"{field}: not a regex: {err}") from None
    if groups < 1:
        raise ValueError(f"{field}: {regex!r} has no group; its first group is the score, "
                         "e.g. 'Score: ([0-9.]+)'")


class JudgeParse(BaseModel):
    """A judge's score read by a regex and checked against its range
    (``parse: {regex, min, max}``)."""

    model_config = _FROZEN

    regex: str
    """Its first group is the score (a float)."""
    min: float = Field(allow_inf_nan=False)
    """The lowest valid score; a lower one leaves the sample unscored."""
    max: float = Field(allow_inf_nan=False)
    """The highest valid score; a higher one leaves the sample unscored."""

    @model_validator(mode="after")
    def _regex_and_range(self) -> JudgeParse:
        _check_score_regex(self.regex, "parse.regex")
        if not self.min < self.max:
            raise ValueError(f"parse.max: {self.max} is not above parse.min {self.min}")
        return self


class JudgeConfig(_Part):
    """A generative judge (rollout/judge.py): a language model asked, greedily, to grade
    each response by ``template``; its answer is parsed into the score."""

    type: Literal["judge"] = "judge"
    """An LLM judge."""
    model: str = Field(default="smollm2-135m-instruct", json_schema_extra=MODEL)
    """As ``rollout.model``: a local folder, ``tiny`` or ``smollm2-135m-instruct``."""
    template: str = ("Question: {prompt}\nAnswer: {response}\nReference answer: {label}\n"
                     "Is the answer correct? Reply with a score from 0 to 10.")
    """The judge's prompt; {prompt}, {response} and {label} are filled in (literal braces
    are doubled: {{ }}). Sent as a user message when the judge has a chat template."""
    parse: str | JudgeParse = BUILT_IN_PARSE
    """``0-10`` (the last number of the answer that stands as a score, 0…10, / 10:
    ``7.``, ``8/10``, ``Score: 9``), ``yes-no`` (the first word: yes 1, no 0), a regex
    whose first group is the score (a finite float), or ``{regex, min, max}`` (the same,
    inside [min, max]); rollout/judge_parse.py. An answer that does not parse, or whose
    score is not finite or out of range, leaves the sample unscored (advantage 0, out of
    its group's baseline) and counts in ``reward/<name>/unparsed``."""
    max_new_tokens: int = Field(default=16, gt=0)
    """Longest judge answer, greedy."""
    max_prompt_tokens: int | None = Field(default=None, gt=0)
    """Longest judge prompt (the template filled in, under the judge's chat template) in
    the judge's tokens. In the gang: at most the judge's context − max_new_tokens, which
    None means. With ``url``: checked only when set, counted with ``tokenizer``."""
    truncation: Literal["left", "right", "refuse"] = "left"
    """A judge prompt over its budget: left cuts the response's beginning (keeping its
    end, where an answer's result is; as a reward model's ``truncation``), right its end;
    refuse leaves the sample unscored. The instructions, question and label are never
    cut (a prompt over the budget without its response is unscored). Counted in
    ``reward/<name>/over_budget``."""
    tokenizer: str | None = Field(default=None, json_schema_extra=FOLDER)
    """With ``url`` and ``max_prompt_tokens``: a local folder of the served model's
    tokenizer, which counts a prompt's tokens (under its chat template, as the server
    applies it). In the gang the judge's own tokenizer counts."""
    url: str | None = None
    """An OpenAI-compatible server (``http://host:port``: SGLang, vLLM, a hosted API)
    serving the judge model at ``/v1/chat/completions``; None: torch engine actors in the
    job's gang."""
    timeout_s: float = Field(default=120.0, gt=0)
    """Longest one request to ``url`` may take."""
    server_model: str = "default"
    """The ``model`` a request to ``url`` names (SGLang answers to ``default``; another
    OpenAI-compatible server to its model's name)."""
    api_key_env: str | None = None
    """An environment variable, where the job runs, holding the key sent to ``url`` as
    ``Authorization: Bearer``; the key itself never goes in a config."""
    api_key_file: str | None = Field(default=None, json_schema_extra=FILE)
    """A file holding that key instead (chmod 600: one readable by group or others is
    refused)."""
    max_retries: int = Field(default=3, ge=0, le=20)
    """Tries again of a request to ``url`` that timed out, found no server, or got 429 or
    5xx (never another 4xx); a request still failing leaves its sample unscored."""
    backoff_s: float = Field(default=1.0, ge=0.0, le=600.0)
    """Wait before retry k (0-based): backoff_s · 2^k · U[0.5, 1]."""
    max_concurrency: int = Field(default=8, ge=1, le=1024)
    """Requests to ``url`` in flight at once."""
    max_unscored_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """With ``url``: the largest share of a step's samples its failed requests may leave
    unscored; more fails the step as a fault that restarts the job from its last
    checkpoint (an unparsed answer never counts here: the server answered)."""
    num_actors: int = Field(default=1, ge=1)
    """Judge engine actors (without url)."""
    num_cpus: float = Field(default=1.0, ge=0.0)
    """CPUs of each judge actor."""
    num_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs of each judge actor."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The judge engine's dtype; auto: float32 on CPU, bfloat16 on a GPU."""

    @model_validator(mode="after")
    def _template_and_parse(self) -> JudgeConfig:
        if "{response}" not in self.template:
            raise ValueError("template: has no {response}; the judge would not see the "
                             "answer it grades")
        try:
            self.template.format(prompt="", response="", label="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"template: only {{prompt}}, {{response}} and {{label}} are "
                             f"filled in (double a literal brace): {err!r}") from None
        if isinstance(self.parse, str) and self.parse not in (BUILT_IN_PARSE, YES_NO_PARSE):
            _check_score_regex(self.parse, "parse")
        if self.url is not None and not re.match(r"^https?://", self.url):
            raise ValueError(f"url: expected http://host:port, got {self.url!r}")
        return self

    @model_validator(mode="after")
    def _prompt_counted(self) -> JudgeConfig:
        if self.url is None and self.tokenizer is not None:
            raise ValueError("tokenizer: only a judge with url takes one (in the gang the "
                             "judge's own tokenizer counts its prompt)")
        if self.url is not None and self.max_prompt_tokens is not None \
                and self.tokenizer is None:
            raise ValueError("tokenizer: a judge with url and max_prompt_tokens needs the "
                             "served model's tokenizer folder to count a prompt's tokens")
        return self

    @model_validator(mode="after")
    def _one_key_source(self) -> JudgeConfig:
        _check_key_source(self.api_key_env, self.api_key_file)
        return self


class HttpRewardConfig(_Part):
    """A remote scalar reward endpoint (rollout/reward_parts/http.py).

    OpenRLHF's ``remote_rm_url`` shape: each batch of samples POSTed as ``{"query":
    [prompt + response], "prompts", "responses", "labels"}``, answered ``{"rewards":
    [one float each]}`` (or the bare list). A call that still fails after its retries
    leaves its samples unscored; more than ``max_unscored_fraction`` of a step unscored
    restarts the job from its checkpoint."""

    type: Literal["http"] = "http"
    """A remote reward endpoint."""
    url: str
    """The endpoint POSTed to, whole (``http://host:5000/get_reward``)."""
    batch_size: int = Field(default=32, ge=1, le=4096)
    """Samples per request."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Longest one request may take."""
    max_retries: int = Field(default=3, ge=0, le=20)
    """Tries again of a request that timed out, found no server, or got 429 or 5xx
    (never another 4xx)."""
    backoff_s: float = Field(default=1.0, ge=0.0, le=600.0)
    """Wait before retry k (0-based): backoff_s · 2^k · U[0.5, 1]."""
    max_concurrency: int = Field(default=4, ge=1, le=1024)
    """Requests in flight at once."""
    api_key_env: str | None = None
    """An environment variable, where the job runs, holding the key sent as
    ``Authorization: Bearer``; the key itself never goes in a config."""
    api_key_file: str | None = Field(default=None, json_schema_extra=FILE)
    """A file holding that key instead (chmod 600: one readable by group or others is
    refused)."""
    max_unscored_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Largest share of a step's samples its failed requests may leave unscored; more
    fails the step as a fault that restarts the job from its last checkpoint."""

    @model_validator(mode="after")
    def _url_and_key(self) -> HttpRewardConfig:
        if not re.match(r"^https?://[^/\s]+", self.url):
            raise ValueError(f"url: expected http://host:port/path, got {self.url!r}")
        _check_key_source(self.api_key_env, self.api_key_file)
        return self


def part_kind(value: Any) -> str:
    """A part's kind (a dict or a config): rule, model, judge, class or http; its registry key
    (rollout/reward_parts). ``type: custom`` is a class part when it names a
    ``class_path`` (else the function rule it has always been: that key keeps its
    meaning)."""
    get = value.get if isinstance(value, dict) else lambda key, default=None: getattr(
        value, key, default)
    kind = get("type", "exact_match")
    if kind == "custom" and get("class_path") is not None:
        return "class"
    return kind if kind in ("model", "judge", "http") else "rule"


RewardPartConfig = Annotated[
    Annotated[RewardConfig, Tag("rule")] | Annotated[RewardModelConfig, Tag("model")]
    | Annotated[JudgeConfig, Tag("judge")] | Annotated[CustomPartConfig, Tag("class")]
    | Annotated[HttpRewardConfig, Tag("http")],
    Discriminator(part_kind),
]
"""One reward part's config: a rule, a reward model, a judge, a user's class or a remote
endpoint."""
RewardPart = RewardPartConfig
"""The config union's former name (rollout/config.py imports it); the scoring interface
of that name is rollout.reward_parts.RewardPart."""

RewardSpec = Annotated[
    Annotated[RewardPartConfig, Tag("one")] | Annotated[list[RewardPartConfig], Tag("list")],
    Discriminator(lambda value: "list" if isinstance(value, list | tuple) else "one"),
]
"""``rollout.reward``: one part, or a list of them."""


def reward_parts(reward: Any) -> list[Any]:
    """``rollout.reward`` as its list of parts (one block is a list of one)."""
    return list(reward) if isinstance(reward, list | tuple) else [reward]


def check_reward_parts(reward: Any) -> None:
    """A list has parts, and their names are unique (ValueError naming the field)."""
    parts = reward_parts(reward)
    if not parts:
        raise ValueError("reward: an empty list; give at least one reward")
    seen: dict[str, int] = {}
    for k, part in enumerate(parts):
        if part.part_name in seen:
            raise ValueError(f"reward[{k}].name: {part.part_name!r} is also reward"
                             f"[{seen[part.part_name]}]'s name; give each part its own")
        seen[part.part_name] = k
