"""jobs, metrics and sweeps

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("mode", sa.String(32), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("config_submitted", sa.Text(), nullable=False),
        sa.Column("overrides", sa.Text(), nullable=False),
        sa.Column("config_resolved", sa.Text(), nullable=False),
        sa.Column("output_dir", sa.Text(), nullable=False),
        sa.Column("ray_submission_id", sa.String(128), nullable=True),
        sa.Column("ray_job_id", sa.String(64), nullable=True),
        sa.Column("driver_pid", sa.Integer(), nullable=True),
        sa.Column("sweep_id", sa.String(32), sa.ForeignKey("sweeps.id"), nullable=True),
        sa.Column("sweep_label", sa.String(200), nullable=True),
        sa.Column("num_steps", sa.Integer(), nullable=False),
        sa.Column("last_step", sa.Integer(), nullable=True),
        sa.Column("reward_mean", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("log_tail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_jobs_name", "jobs", ["name"])
    op.create_index("ix_jobs_ray_submission_id", "jobs", ["ray_submission_id"])
    op.create_index("ix_jobs_sweep_id", "jobs", ["sweep_id"])
    op.create_index("ix_jobs_status_created", "jobs", ["status", "created_at"])
    op.create_table(
        "metrics",
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("step", sa.Integer(), primary_key=True),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("values", sa.Text(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("metrics")
    op.drop_index("ix_jobs_status_created", table_name="jobs")
    op.drop_index("ix_jobs_sweep_id", table_name="jobs")
    op.drop_index("ix_jobs_ray_submission_id", table_name="jobs")
    op.drop_index("ix_jobs_name", table_name="jobs")
    op.drop_table("jobs")
    op.drop_table("sweeps")
