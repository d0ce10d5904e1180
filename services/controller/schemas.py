"""Request and response models of the controller's REST API (``/api``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.config import AggregationMode

JobStatus = Literal["queued", "pending", "running", "succeeded", "failed", "cancelled"]


class _Config(BaseModel):
    """A job config: a JSON object, or YAML text, plus ``key.path=value`` overrides."""

    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any] | None = None
    """The job config as a JSON object (the YAML file's content)."""
    config_yaml: str | None = Field(default=None, max_length=512_000)
    """The job config as YAML text (alternative to `config`)."""
    overrides: list[str] = Field(default_factory=list, max_length=100)
    """``key.path=value`` overrides, applied in order (like ``--set``)."""

    @model_validator(mode="after")
    def _one_config(self) -> _Config:
        if self.config is not None and self.config_yaml is not None:
            raise ValueError("give either config or config_yaml, not both")
        if any(len(item) > 2000 for item in self.overrides):
            raise ValueError("overrides: each override is at most 2000 characters")
        return self


class JobSubmit(_Config):
    """Submit one job."""


class SweepSubmit(_Config):
    """One config, many jobs: one per aggregation mode, or one per set of overrides."""

    name: str | None = Field(default=None, max_length=100)
    """Sweep name (default: the config's name)."""
    modes: list[AggregationMode] | None = Field(default=None, min_length=1, max_length=4)
    """One job per aggregation mode (constant gets divisor max_response_len if unset)."""
    override_sets: list[list[str]] | None = Field(default=None, min_length=1, max_length=32)
    """One job per list of extra overrides."""

    @model_validator(mode="after")
    def _one_axis(self) -> SweepSubmit:
        if (self.modes is None) == (self.override_sets is None):
            raise ValueError("give exactly one of modes or override_sets")
        if self.modes is not None and len(set(self.modes)) != len(self.modes):
            raise ValueError("modes: each mode once")
        for overrides in self.override_sets or []:
            if len(overrides) > 100 or any(len(item) > 2000 for item in overrides):
                raise ValueError("override_sets: at most 100 overrides of 2000 characters")
        return self


class JobRegister(BaseModel):
    """A job started elsewhere (``ray job submit``, ``python -m services.train``)."""

    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any]
    """The job's config (as the driver resolved it)."""
    output_dir: str = Field(min_length=1, max_length=4096)
    """The job folder holding metrics.jsonl."""


class StatusReport(BaseModel):
    """A driver reporting its own end (or start)."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["running", "succeeded", "failed"]
    error: str | None = Field(default=None, max_length=20_000)


MetricName = Annotated[str, Field(min_length=1, max_length=200)]
FiniteValue = Annotated[float, Field(allow_inf_nan=False)]


class MetricRowIn(BaseModel):
    """One step; a value the driver could not represent (NaN, ±inf) is sent as null,
    so a non-finite number here is refused (422), never stored."""

    step: int = Field(ge=0, le=2**31 - 1)
    time: FiniteValue | None = None
    metrics: dict[MetricName, FiniteValue | None] = Field(max_length=1000)


class MetricsIngest(BaseModel):
    """A batch of training steps from the driver's ControllerSink."""

    model_config = ConfigDict(extra="forbid")

    rows: list[MetricRowIn] = Field(max_length=5000)
    ray_job_id: str | None = Field(default=None, max_length=64)
    """Ray's job id (hex) once the driver joined a cluster (registered jobs)."""
    driver_pid: int | None = Field(default=None, ge=0, le=2**31 - 1)
    """The driver's PID, which tells its Ray submission apart from another cluster's."""


class IngestResult(BaseModel):
    accepted: int


class JobOut(BaseModel):
    id: str
    name: str
    status: JobStatus
    mode: str
    """The chosen pg aggregation mode."""
    source: Literal["controller", "registered"]
    sweep_id: str | None
    sweep_label: str | None
    ray_submission_id: str | None
    output_dir: str
    num_steps: int
    last_step: int | None
    reward_mean: float | None
    error: str | None
    created_at: float
    """Unix seconds."""
    started_at: float | None
    finished_at: float | None


class JobEvent(BaseModel):
    """Something the driver recorded about the job's actors (placement, failure, restart)."""

    time: float
    kind: str
    message: str


class JobDetail(JobOut):
    config_submitted: str
    overrides: list[str]
    config_resolved: dict[str, Any]
    log_tail: str | None
    """The last log lines of a failed job."""
    events: list[JobEvent] = []
    """The driver's events.jsonl in the job folder: where actors landed, restarts."""


class JobList(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int


class MetricsOut(BaseModel):
    """Column-oriented: ``series[name][i]`` is the value at ``steps[i]``."""

    job_id: str
    names: list[str]
    """Every metric name the job logged."""
    steps: list[int]
    series: dict[str, list[float | None]]
    total_points: int
    """Steps in the requested range before downsampling."""
    downsampled: bool


class SweepOut(BaseModel):
    id: str
    name: str
    created_at: float
    axis: Literal["modes", "override_sets"]
    status: JobStatus
    """The least finished status of its jobs."""
    jobs: list[JobOut]


class SweepList(BaseModel):
    items: list[SweepOut]
    total: int


class SweepRun(BaseModel):
    job_id: str
    label: str
    mode: str
    status: JobStatus
    steps: list[int]
    series: dict[str, list[float | None]]


class SweepMetricsOut(BaseModel):
    sweep_id: str
    names: list[str]
    runs: list[SweepRun]


class FieldError(BaseModel):
    field: str
    """Dotted path of the field (``rollout.global_batch_size``, ``query.limit``)."""
    message: str


class ValidationErrorOut(BaseModel):
    """422: an invalid request or job config; nothing was started or stored."""

    detail: str
    errors: list[FieldError]


class Message(BaseModel):
    detail: str


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    database: bool
    ray: str


class SampleTokensOut(BaseModel):
    """A training sample's response token by token (rollout/sample_record.SampleTokens,
    the ``tokens`` object of a samples.jsonl line): one entry per response position in
    every list. The trainer-vs-engine gap of a token is ``trainer_log_prob −
    engine_log_prob``. A value written as ``null`` (not recorded, or not finite) stays
    null."""

    text: list[str]
    """Each position's token decoded alone (special tokens kept)."""
    observation: list[bool]
    """True: an environment's observation (multi-turn), not written by the policy."""
    advantage: list[float | None]
    """A_t the step trained with (0 on observations)."""
    engine_log_prob: list[float | None]
    """The engine's (behaviour) log-prob of the token; null on observations."""
    trainer_log_prob: list[float | None]
    """The trainer's log-prob under the weights the step trains from; null on
    observations or when the trainer was not asked."""
    entropy: list[float | None]
    """The trainer's entropy at the position (nats); null where trainer_log_prob is."""

    @model_validator(mode="after")
    def _one_entry_per_token(self) -> SampleTokensOut:
        count = len(self.text)
        for name in ("observation", "advantage", "engine_log_prob", "trainer_log_prob",
                     "entropy"):
            if len(getattr(self, name)) != count:
                raise ValueError(f"tokens.{name}: {len(getattr(self, name))} entries for "
                                 f"{count} tokens")
        return self


class SampleOut(BaseModel):
    """One sample as text, a line of the job folder's samples.jsonl (services/driver/
    samples.py); a training sample has ``index`` and ``advantage``, an evaluation sample
    ``eval`` and ``greedy``."""

    step: int
    """The rollout step; of an evaluation sample, the weight version evaluated."""
    eval: bool = False
    """An evaluation sample (held-out prompt), not a trained one."""
    greedy: bool | None = None
    """Of an evaluation sample: the greedy response, or one sampled for pass@k."""
    index: int | None = None
    """Of a training sample: its place in the rollout's batch."""
    group: int | None = None
    """The prompt group (training) or held-out prompt (evaluation) it answers."""
    prompt: str = ""
    """The prompt as the policy saw it (its chat template's text)."""
    record_prompt: Any = None
    """The prompt as the dataset holds it (text or chat messages)."""
    response: str = ""
    label: Any = None
    reward: float | None = None
    """The reward: the weighted sum of its parts; null when a part left it unscored."""
    rewards: dict[str, float | None] = {}
    """Each reward part's value, by the part's name (null: that part did not score it)."""
    judge_answers: dict[str, str | None] = {}
    """A judge part's raw answer, by the part's name."""
    advantage: float | None = None
    """Of a training sample: the mean advantage over its response tokens."""
    response_tokens: int | None = None
    tokens: SampleTokensOut | None = None
    """Of a training sample whose tokens the driver recorded (logging.sample_tokens), with
    ``tokens=true``: the response token by token."""
    has_tokens: bool = False
    """True: the sample has a per-token record (sent with ``tokens=true``); left out of
    a sample without one."""


class SamplesOut(BaseModel):
    """Samples of one job, in file order; unset fields of a sample are left out."""

    job_id: str
    steps: list[int]
    """Rollout steps with training samples, ascending."""
    eval_steps: list[int]
    """Weight versions with evaluation samples, ascending."""
    total: int
    """Samples matching ``step`` and ``eval`` before ``limit``."""
    samples: list[SampleOut]
    note: str | None
    """Why there are none to read (no samples.jsonl yet, a folder the controller may not
    read)."""
