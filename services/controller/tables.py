"""SQLAlchemy tables of the controller: jobs, per-step metrics, sweeps, training sessions.

Times are Unix seconds (floats) so every SQL backend stores them alike. A step's metrics
are one row holding a JSON object (name -> float | null): one insert per step keeps
ingestion cheap, and a chart reads a step range of one job by primary key.
Migrations: ``services/controller/migrations`` (Alembic), applied at startup.
"""

from __future__ import annotations

from sqlalchemy import Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


ACTIVE = ("pending", "running")
"""Statuses of a job that Ray is running (or about to)."""
TERMINAL = ("succeeded", "failed", "cancelled")
STATUSES = ("queued", *ACTIVE, *TERMINAL)


class Sweep(Base):
    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    spec: Mapped[str] = mapped_column(Text)
    """JSON: the base config as submitted, its overrides and the varied axis."""
    created_at: Mapped[float] = mapped_column(Float)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_status_created", "status", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
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


class MetricRow(Base):
    __tablename__ = "metrics"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"),
                                        primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    time: Mapped[float] = mapped_column(Float)
    values: Mapped[str] = mapped_column(Text)
    """JSON object: metric name -> float or null."""


SESSION_LIVE = ("starting", "ready")
"""Statuses of a training session whose process runs (or is starting)."""


class TrainingSessionRow(Base):
    """A training session (services/sessions): its process is a Ray job; this row is what
    the controller knows of it (the live numbers come from the session itself)."""

    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    """starting, ready, ended (closed or idle; its state saved) or failed."""
    model: Mapped[str] = mapped_column(Text)
    world_size: Mapped[int] = mapped_column(Integer)
    config_submitted: Mapped[str] = mapped_column(Text)
    config_resolved: Mapped[str] = mapped_column(Text)
    output_dir: Mapped[str] = mapped_column(Text)
    ray_submission_id: Mapped[str] = mapped_column(String(128))
    # No secret: the session server's is derived from the controller's key (revision 0004,
    # services/controller/session_secret.py).
    step: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(Integer, default=0)
    """Weighted tokens its forward_backward calls trained on."""
    loss: Mapped[float | None] = mapped_column(Float)
    """The loss of its last optimizer step."""
    pending_calls: Mapped[int] = mapped_column(Integer, default=0)
    saved_path: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
