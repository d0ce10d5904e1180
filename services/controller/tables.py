"""SQLAlchemy tables of the controller: runs (jobs, training sessions, reward-model
trainings: one row each, ``kind`` says which), per-step metrics, sweeps.

Times are Unix seconds (floats) so every SQL backend stores them alike. A step's metrics
are one row holding a JSON object (name -> float | null): one insert per step keeps
ingestion cheap, and a chart reads a step range of one job by primary key.
Migrations: ``services/controller/migrations`` (Alembic), applied at startup.
"""

from __future__ import annotations

from sqlalchemy import Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from services.controller.run_states import ACTIVE, JOB_KINDS, KINDS, STATUSES, TERMINAL

__all__ = ["ACTIVE", "JOB_KINDS", "KINDS", "STATUSES", "TERMINAL", "Base", "MetricRow", "Run",
           "Sweep"]


class Base(DeclarativeBase):
    pass


class Sweep(Base):
    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    spec: Mapped[str] = mapped_column(Text)
    """JSON: the base config as submitted, its overrides and the varied axis."""
    created_at: Mapped[float] = mapped_column(Float)


class Run(Base):
    """One run the controller knows of, of any kind: its status (run_states.py, one state
    machine), its Ray submission, its folder and config. The columns after
    ``idempotency_key`` are a session's (null for the other kinds): what the dashboard
    shows of it and what its server is started with (job_env.py ``run_env``)."""

    __tablename__ = "runs"
    __table_args__ = (Index("ix_jobs_status_created", "status", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), default="job", index=True)
    """job, session or train_rm (run_states.KINDS)."""
    name: Mapped[str] = mapped_column(String(100), index=True)
    status: Mapped[str] = mapped_column(String(16))
    mode: Mapped[str] = mapped_column(String(32))
    """The chosen pg aggregation mode (config.aggregation.mode)."""
    source: Mapped[str] = mapped_column(String(16))
    """'controller' (submitted here) or 'registered' (started elsewhere, e.g. ray job submit)."""
    config_submitted: Mapped[str] = mapped_column(Text)
    """The config text as submitted (YAML or JSON), before overrides."""
    overrides: Mapped[str] = mapped_column(Text, default="[]")
    """JSON list of ``key=value`` overrides applied to it."""
    config_resolved: Mapped[str] = mapped_column(Text)
    """JSON of the validated JobConfig with every default and resolved path."""
    output_dir: Mapped[str] = mapped_column(Text)
    ray_submission_id: Mapped[str | None] = mapped_column(String(128), index=True)
    ray_job_id: Mapped[str | None] = mapped_column(String(64))
    driver_pid: Mapped[int | None] = mapped_column(Integer)
    """PID of a registered job's driver: with ray_job_id it finds the Ray submission."""
    sweep_id: Mapped[str | None] = mapped_column(ForeignKey("sweeps.id"), index=True)
    sweep_label: Mapped[str | None] = mapped_column(String(200))
    num_steps: Mapped[int] = mapped_column(Integer)
    last_step: Mapped[int | None] = mapped_column(Integer)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    log_tail: Mapped[str | None] = mapped_column(Text)
    """Last log lines of a failed job ("" otherwise); null until Ray confirmed the end."""
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True, index=True)
    """The submit's ``Idempotency-Key`` header: the same key returns this job again."""
    model: Mapped[str | None] = mapped_column(Text)
    world_size: Mapped[int | None] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(Integer, default=0)
    """A session's optimizer steps so far."""
    tokens: Mapped[int | None] = mapped_column(Integer, default=0)
    """Weighted tokens a session's forward_backward calls trained on."""
    loss: Mapped[float | None] = mapped_column(Float)
    """The loss of a session's last optimizer step."""
    pending_calls: Mapped[int | None] = mapped_column(Integer, default=0)
    saved_path: Mapped[str | None] = mapped_column(Text)
    """Where a session's state was saved as it ended."""
    idle_timeout_s: Mapped[float | None] = mapped_column(Float)
    """A session ends after this long without a call (None: the controller's default)."""
    advertise_host: Mapped[str | None] = mapped_column(Text)
    """The address a session's server gives the controller (None: its node's IP)."""


class MetricRow(Base):
    __tablename__ = "metrics"

    job_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"),
                                        primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    time: Mapped[float] = mapped_column(Float)
    values: Mapped[str] = mapped_column(Text)
    """JSON object: metric name -> float or null."""
